"""Prometheus histograms fed a whole cell (a bucket's count and summed seconds) at a time.

The engine reports its calls and transfers as cells (see
:mod:`kvcompose.wire.calls`); the front-end turns each cell back into
observations through the series' public ``observe``. prometheus_client has no
public way to add to a bucket in bulk (its maintainers point to custom
collectors, which neither vLLM's metric types, Ray's among them, nor
multiprocess mode can take), so a cell of ``count`` calls is ``count``
observations inside its bucket: the bucket counts and ``_sum`` come out as
if each call had been observed as it happened.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

TRACE_ID_LABEL = "trace_id"  # the exemplar label Grafana links to a trace (exemplarTraceIdDestinations)


CellAdder = Callable[[int, int, float, "tuple[str, float] | None"], None]  # (bucket, count, seconds, exemplar)


def cell_adder(series: Any, bounds: Sequence[float]) -> CellAdder:
    """How to add a cell to ``series``: ``add(bucket, count, seconds, exemplar)`` adds ``count`` values
    adding up to ``seconds``, all inside ``bucket`` of ``bounds``; ``exemplar`` (trace id, seconds of one of
    those values) becomes the bucket's exemplar."""
    return functools.partial(replay_cell, series, bounds)


def replay_cell(
    series: Any, bounds: Sequence[float], bucket: int, count: int, seconds: float,
    exemplar: tuple[str, float] | None = None,
) -> None:
    """Observe ``count`` values adding up to ``seconds``, all inside ``bucket`` of ``bounds``.

    With an ``exemplar`` (trace id, seconds of one of those values), that value is observed last,
    carrying the trace id, and the others at their mean (which lies in the bucket too).
    """
    if exemplar is not None:
        count, seconds = count - 1, seconds - exemplar[1]
    if count:
        mean = _inside(seconds / count, bounds, bucket)  # float rounding may push a mean over a bound
        for _ in range(count):
            series.observe(mean)
    if exemplar is not None:
        series.observe(_inside(exemplar[1], bounds, bucket), exemplar={TRACE_ID_LABEL: exemplar[0]})


def _inside(value: float, bounds: Sequence[float], bucket: int) -> float:
    """``value``, moved into bucket ``bucket`` (``bounds[bucket-1] < v <= bounds[bucket]``) if it is not."""
    if bucket < len(bounds) and value > bounds[bucket]:
        return bounds[bucket]
    if bucket and value <= bounds[bucket - 1]:
        return math.nextafter(bounds[bucket - 1], math.inf)
    return value
