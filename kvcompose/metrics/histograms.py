"""Prometheus histograms fed a whole cell (a bucket's count and summed seconds) at a time.

prometheus_client has no public way to add to a bucket in bulk: its
maintainers decline a count argument to ``observe`` and point to custom
collectors (client_python issues 733, 911 and 1124), which neither vLLM's
metric types (Ray swaps them) nor multiprocess mode (only the metric classes
write the shared files) can take. Its own ``Histogram`` keeps each bucket and
the sum as a value object with ``inc(amount)`` (``_buckets``, ``_sum``), in
memory or in multiprocess mode's files alike, so where a series is one of
those, a cell is added as one bucket increment and one sum increment: what
``count`` observations inside the bucket add, at the cost of one. Anything
else (Ray's wrappers, a release whose internals differ: checked per series) is
fed ``count`` observations inside the bucket, which come out the same. Either
way the bucket counts and ``_sum`` are exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import Histogram
from prometheus_client.samples import Exemplar

TRACE_ID_LABEL = "trace_id"  # the exemplar label Grafana links to a trace (exemplarTraceIdDestinations)


CellAdder = Callable[[int, int, float, "tuple[str, float] | None"], None]  # (bucket, count, seconds, exemplar)


def cell_adder(series: Any, bounds: Sequence[float]) -> CellAdder:
    """How to add a cell to ``series``: ``add(bucket, count, seconds, exemplar)`` adds ``count`` values
    adding up to ``seconds``, all inside ``bucket`` of ``bounds``; ``exemplar`` (trace id, seconds of one of
    those values) becomes the bucket's exemplar. Decided once per series: make it when the series is made."""
    if not adds_in_bulk(series, bounds):
        return lambda bucket, count, seconds, exemplar: replay_cell(series, bounds, bucket, count, seconds, exemplar)
    total, buckets = series._sum, series._buckets

    def add(bucket: int, count: int, seconds: float, exemplar: tuple[str, float] | None) -> None:
        total.inc(seconds)
        buckets[bucket].inc(count)
        if exemplar is not None:
            value = _inside(exemplar[1], bounds, bucket)
            buckets[bucket].set_exemplar(Exemplar({TRACE_ID_LABEL: exemplar[0]}, value, time.time()))

    return add


def adds_in_bulk(series: Any, bounds: Sequence[float]) -> bool:
    """Is ``series`` a prometheus_client histogram child with ``bounds``, whose buckets and sum take ``inc``?"""
    buckets = getattr(series, "_buckets", None)
    return (
        isinstance(series, Histogram)
        and getattr(series, "_upper_bounds", None) == [*bounds, math.inf]
        and isinstance(buckets, list) and len(buckets) == len(bounds) + 1
        and all(hasattr(value, "inc") for value in (*buckets, getattr(series, "_sum", None)))
    )


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
