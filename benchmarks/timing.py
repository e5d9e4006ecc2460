"""Per-call cost of several subjects running one statement, measured side by side.

The machines are shared and noisy, so no figure is taken alone: each round
times every subject once (in a rotating order), and each subject keeps its
fastest round. Compare subjects by the ratio of those minima.
"""

from __future__ import annotations

import timeit
from collections.abc import Mapping
from typing import Any


def calls_per_sample(timer: timeit.Timer, sample_s: float) -> int:
    """How many calls take about ``sample_s`` (at least one)."""
    calls = 1
    while (elapsed := timer.timeit(calls)) < sample_s / 10:
        calls *= 10
    return max(1, round(calls * sample_s / max(elapsed, 1e-9)))


def per_call_ns(
    statement: str, subjects: Mapping[str, Mapping[str, Any]], rounds: int = 5, sample_s: float = 0.05,
    calls: int | None = None,
) -> dict[str, float]:
    """Fastest per-call time, in ns, of ``statement`` run with each subject's globals.

    ``calls`` fixes the calls per sample (smoke tests); by default each subject
    gets as many as fill ``sample_s``.
    """
    timers = {name: timeit.Timer(statement, globals=dict(namespace)) for name, namespace in subjects.items()}
    counts = {name: calls or calls_per_sample(timer, sample_s) for name, timer in timers.items()}
    best = dict.fromkeys(timers, float("inf"))
    names = list(timers)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            best[name] = min(best[name], timers[name].timeit(counts[name]) / counts[name] * 1e9)
    return best
