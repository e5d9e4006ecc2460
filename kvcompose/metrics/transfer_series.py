"""The Prometheus series of each child's transfers, fed a TransferTable at a time.

Per engine, child (``connector``) and ``direction``: the lifetime histogram
(its buckets' exemplars link to the traces), the copy-time histogram (labelled
with where the child's copy times come from, ``source``), bytes moved and
the bytes of the transfers with a copy time (the copy throughput's bytes; a
child and direction that records no copy time, such as NIXL's saves, has
neither copy series),
transfers in flight, failures by ``outcome`` and engine wait, every series
created at 0 at start-up so that ``rate()`` sees the first transfer. The three
times are defined in kvcompose.instrumentation.transfers.

Exemplars: prometheus_client writes them only in OpenMetrics. vLLM's server
answers ``/metrics/`` (with the slash) from the prometheus_client app it
mounts, which speaks OpenMetrics when the scraper asks for it (Prometheus
does); ``/metrics`` itself is answered by prometheus-fastapi-instrumentator's
handler, always in the classic text format, without exemplars. In
multiprocess mode (several API servers) exemplars are dropped: prometheus_client
keeps none in its shared files. Ray's histograms take none either.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from kvcompose.metrics.histograms import CellAdder, cell_adder
from kvcompose.operations import DIRECTIONS
from kvcompose.wire.transfers import FAILURES, TransferTable


@dataclass
class _Lane:
    """The series of one engine, child and direction."""

    lifetime: Any
    add_lifetime: CellAdder
    add_copy: CellAdder | None  # None: no copy time is recorded in this lane
    moved_bytes: Any
    copied_bytes: Any
    engine_wait: Any
    in_flight: Any
    failures: tuple[Any, ...]  # by outcome, in FAILURES' order
    in_flight_now: int = 0  # the sum of the changes this process received


class TransferSeries:
    def __init__(
        self,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        children: Sequence[str],
        copy_sources: Sequence[Mapping[str, str | None]],
        bounds: Sequence[float],
    ) -> None:
        """``labelnames``: vLLM's and the child's (``connector``); ``direction`` is added. ``copy_sources``: per
        child and direction, where its copy times come from (``child`` or ``calls``; None: none is recorded)."""
        names = [*labelnames, "direction"]
        lifetime = metric_types[Histogram](
            "kvcompose_transfer_lifetime_seconds",
            "Lifetime of each child's KV transfers: from the step that issues one until the engine learns it is "
            "done, failed or aborted (a load's wait; how long a save holds its blocks).",
            labelnames=names,
            buckets=list(bounds),
        )
        copy = metric_types[Histogram](
            "kvcompose_transfer_copy_seconds",
            "Time each child spent moving a transfer's bytes: its own measurement (source=child), or the time "
            "inside kvcompose's calls into it that moved them (source=calls).",
            labelnames=[*names, "source"],
            buckets=list(bounds),
        )
        engine_wait = metric_types[Counter](
            "kvcompose_engine_wait_seconds",
            "Seconds the forward pass spent inside each child's blocking calls (start_load_kv, wait_for_layer_load: "
            "load; save_kv_layer, wait_for_save: save).",
            labelnames=names,
        )
        moved_bytes = metric_types[Counter](
            "kvcompose_transfer_bytes_total",
            "Bytes of KV in each child's ended transfers, whatever their outcome (failed and aborted ones too).",
            labelnames=names,
        )
        copied_bytes = metric_types[Counter](
            "kvcompose_transfer_copied_bytes_total",
            "Bytes of KV in each child's transfers that have a copy time: over kvcompose_transfer_copy_seconds_sum, "
            "the copy throughput.",
            labelnames=[*names, "source"],
        )
        # Each API server adds up the changes it received; the engine's count is their sum,
        # dead processes' shares included (a transfer may start in one share and end in another).
        in_flight = metric_types[Gauge](
            "kvcompose_transfers_in_flight",
            "Each child's KV transfers started and not yet ended.",
            labelnames=names,
            multiprocess_mode="sum",
        )
        failed = metric_types[Counter](
            "kvcompose_transfers_failed_total",
            "Each child's KV transfers that failed or were aborted, by outcome.",
            labelnames=[*names, "outcome"],
        )
        self._children = tuple(children)
        self._bounds = tuple(bounds)
        self._lanes: dict[int, list[_Lane]] = {}
        for engine_idx, engine_labels in per_engine_labelvalues.items():
            lanes = self._lanes[engine_idx] = []
            for child, sources in zip(children, copy_sources, strict=True):
                for direction in DIRECTIONS:
                    labels = (*engine_labels, child, direction)
                    series = lifetime.labels(*labels)
                    failures = tuple(failed.labels(*labels, outcome) for outcome in FAILURES)
                    source = sources[direction]
                    lane = _Lane(series, cell_adder(series, self._bounds),
                                 None if source is None else cell_adder(copy.labels(*labels, source), self._bounds),
                                 moved_bytes.labels(*labels),
                                 None if source is None else copied_bytes.labels(*labels, source),
                                 engine_wait.labels(*labels), in_flight.labels(*labels), failures)
                    lane.in_flight.set(0)
                    lanes.append(lane)
        some_lane = next(iter(self._lanes.values()))[0]
        self._exemplars = "exemplar" in inspect.signature(some_lane.lifetime.observe).parameters

    def observe(self, table: TransferTable, engine_idx: int) -> None:
        if table.children != self._children or table.buckets != len(self._bounds) + 1:
            raise ValueError(
                f"kvcompose: transfer stats of another pipeline ({table.children}, {table.buckets} buckets) reached "
                f"the metrics of {self._children} ({len(self._bounds) + 1} buckets)"
            )
        lanes = self._lanes[engine_idx]
        for cell, (count, seconds) in table.cells.items():
            lane, bucket = divmod(cell, table.buckets)
            exemplar = table.exemplars.get(cell) if self._exemplars else None
            lanes[lane].add_lifetime(bucket, count, seconds, None if exemplar is None else (exemplar[1], exemplar[2]))
        for cell, (count, seconds) in table.copy_cells.items():
            lane, bucket = divmod(cell, table.buckets)
            if (add_copy := lanes[lane].add_copy) is not None:  # the tracker gives such a lane no copy time
                add_copy(bucket, count, seconds, None)
        for lane, moved, copied, change, waited in zip(lanes, table.moved_bytes, table.copied_bytes, table.in_flight,
                                                       table.waited, strict=True):
            if moved:
                lane.moved_bytes.inc(moved)
            if copied and lane.copied_bytes is not None:
                lane.copied_bytes.inc(copied)
            if waited:
                lane.engine_wait.inc(waited)
            if change:
                lane.in_flight_now += change
                lane.in_flight.set(lane.in_flight_now)  # Ray's gauges have no inc()
        for index, failed in enumerate(table.failures):
            if failed:
                lane_index, outcome = divmod(index, len(FAILURES))
                lanes[lane_index].failures[outcome].inc(failed)
