"""Engine-process CPU at production request rates, tracing every request: the share of one core it costs.

Open loop: at each rate, each subject of ``benchmarks/request_life.py`` (2
no-op children) serves whole request lives released on a fixed schedule,
request ``i`` due ``i / rate`` seconds after the start; the driver sleeps until
a request is due, and not at all when behind. The figure is this process's CPU
time (``time.process_time``: every thread) over the schedule's wall time: the
share of one core the scheduler-side connector work takes at that rate (making
each vLLM request included, the same for every subject), beside the rate
achieved. Subjects take turns in rotating order, a few rounds; each figure is
the median. The span exporter process's CPU over the same window is shown
apart: it is not the engine's core, but it is a core's share all the same.

A life that starts after a sleep finds colder caches than one that follows
another, so per request it costs more than ``benchmarks/request_cost.py``'s
back-to-back figure; the sleeping itself is in every subject's share alike.

Rate 0 is an idle engine right after traffic: no request, only what kvcompose's
threads and exporter process do on their own (wake-ups cost about 0.1 ms of
CPU each on these machines).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.request_life import SUBJECTS, Collector, live, rotated, subjects, warm_up
from benchmarks.stopwatch import exporter_cpu_s
from kvcompose.tracing import force_flush

RATES = (0, 100, 1000)  # requests/s; 0: idle
CHILDREN = 2
SECONDS = 2.0  # per subject, rate and round


def _sleep_until(due: float) -> None:
    if (delay := due - time.perf_counter()) > 0:
        time.sleep(delay)


def _drive(connector: Any, rate: int, seconds: float, prefix: str) -> dict[str, float]:
    """Serve ``rate`` requests/s for ``seconds``: shares of one core (this process, the exporter) and the rate
    achieved, over the schedule's wall time (to the end of the last request's slot, or later when behind)."""
    count = round(rate * seconds)
    exporter, cpu, start = exporter_cpu_s(), time.process_time(), time.perf_counter()
    for index in range(count):
        _sleep_until(start + index / rate)
        live(connector, f"{prefix}-{index}")
    if count:
        force_flush()  # the spans of the window's last 0.1 s, which the outboxes' thread would ship in the next one
    _sleep_until(start + (count / rate if rate else seconds))
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    return {"core_share": cpu / wall, "exporter_share": (exporter_cpu_s() - exporter) / wall,
            "achieved_per_s": count / wall}


def _at_rate(served: dict[str, Any], rate: int, rounds: int, seconds: float) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SUBJECTS}
    for round_index in range(rounds):
        for name in rotated(round_index):
            runs[name].append(_drive(served[name], rate, seconds, f"{name}-{rate}-{round_index}"))
    row: dict[str, Any] = {"rate": rate, "children": CHILDREN}
    for figure in ("core_share", "exporter_share", "achieved_per_s"):
        row[figure] = {name: statistics.median(run[figure] for run in runs[name]) for name in SUBJECTS}
    row["extra_share"] = {name: row["core_share"][name] - row["core_share"]["multi"] for name in SUBJECTS[1:]}
    return row


def measure(rounds: int = 5, seconds: float = SECONDS) -> list[dict[str, Any]]:
    with Collector() as sink:
        served = subjects(CHILDREN, sink.endpoint)
        try:
            warm_up(served, "rate")
            rows = [_at_rate(served, rate, rounds, seconds) for rate in RATES]
        finally:
            served["kvc_traced"].shutdown()  # the exporter process flushes and exits
    for row in rows:
        row["sink_exports"], row["sink_bytes"] = sink.exports, sink.bytes
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| requests/s | MultiConnector: % of a core | kvcompose off: extra | tracing every request: extra | "
             "achieved requests/s (multi, off, traced) | exporter process, tracing: % of a core |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        achieved = " / ".join(f"{row['achieved_per_s'][name]:.0f}" for name in SUBJECTS)
        lines.append(f"| {row['rate'] or '0 (idle)'} | {row['core_share']['multi']:.2%} | "
                     f"{row['extra_share']['kvc_off']:+.2%} | {row['extra_share']['kvc_traced']:+.2%} | {achieved} | "
                     f"{row['exporter_share']['kvc_traced']:.2%} |")
    exports = rows[0]["sink_exports"] if rows else 0
    return ("\n".join(lines) + f"\n\nShares of one core, medians of the rounds; extra: percentage points over "
            f"MultiConnector. The collector stand-in received {exports} exports.")
