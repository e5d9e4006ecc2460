"""Prometheus metrics for a pipeline, built through vLLM's KVConnectorPromMetrics.

vLLM calls ``build_prom_metrics`` in the front-end with its own metric types
(Ray swaps them) and label names (model_name, engine); kvcompose adds a
``connector`` label holding the child's pipeline name.

Children's own metrics are built once per child class with an extra
``connector`` label. Each (engine, child) pair gets its own synthetic engine
index, so two children of one class no longer register the same series
twice (vLLM issue 39906) and stay apart on the dashboard.

Histograms are fed whole cells (kvcompose.metrics.histograms); the transfer
series, exemplars included, are kvcompose.metrics.transfer_series.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvcompose.adapters.completion import copy_source
from kvcompose.live import LiveView, engine_ids
from kvcompose.metrics.economics import EconomicsSeries
from kvcompose.metrics.histograms import CellAdder, cell_adder
from kvcompose.metrics.routing import RoutingSeries
from kvcompose.metrics.running_calls import RunningCallSeries
from kvcompose.metrics.tenants import TenantSeries
from kvcompose.metrics.transfer_series import TransferSeries
from kvcompose.wire.calls import COUNTERS, CallTable
from kvcompose.wire.economics import EconomicsReport
from kvcompose.wire.native import NativeStats
from kvcompose.wire.routing import RoutingReport
from kvcompose.wire.stats import (
    BREAKERS_KEY,
    CALLS_KEY,
    ECONOMICS_KEY,
    NATIVE_KEY,
    ROUTING_KEY,
    TELEMETRY_KEY,
    TENANTS_KEY,
    TRANSFERS_KEY,
)
from kvcompose.wire.telemetry import DROP_REASONS, LIVE_SPANS_QUEUED, TelemetryCounters
from kvcompose.wire.tenants import TenantReport
from kvcompose.wire.transfers import TransferTable

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvcompose.child_spec import ChildSpec
    from kvcompose.config import Pipeline

CONNECTOR_LABEL = "connector"
METRIC_PREFIX = "kvcompose_"

# Each counter of a CallTable: the attribute holding its Prometheus counter, and extra label values.
_COUNTER_SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "lookup_hits": ("lookups", ("hit",)),
    "lookup_misses": ("lookups", ("miss",)),
    "matched_tokens": ("matched_tokens", ()),
    "loaded_tokens": ("loaded_tokens", ()),
    "forgone_tokens": ("forgone_tokens", ()),
}


# Every collector kvcompose made in this process, so that a later engine can drop them.
_made: list[Any] = []


def _remembered(metric_type: Any) -> Any:
    """``metric_type``, as a factory that also remembers each collector it makes."""

    def make(*args: Any, **kwargs: Any) -> Any:
        collector = metric_type(*args, **kwargs)
        _made.append(collector)
        return collector

    return make


def unregister_kvcompose_metrics() -> None:
    """Drop the series kvcompose registered in prometheus_client's default registry.

    A second engine in one process (two ``LLM`` objects, a test session)
    builds the metrics again, and the default registry refuses a name it
    holds ("Duplicated timeseries"). vLLM drops its own ``vllm:`` series at
    that point and kvcompose drops its ``kvcompose_`` ones, so the newest
    engine's series are exported.
    """
    while _made:
        collector = _made.pop()
        try:
            REGISTRY.unregister(collector)
        except KeyError:  # not in the default registry: Ray's metric types, or already dropped
            pass


class KVComposePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        pipeline: Pipeline,
        specs: list[ChildSpec],
    ) -> None:
        unregister_kvcompose_metrics()
        children_metric_types = metric_types  # the children's own (vllm:) series are vLLM's to drop
        metric_types = {base: _remembered(made) for base, made in metric_types.items()}
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = [*labelnames, CONNECTOR_LABEL]
        self._latency_bounds = tuple(pipeline.metrics.latency_buckets)
        self.duration = self._histogram_cls(
            "kvcompose_call_duration_seconds",
            "Latency of kvcompose's calls into each child connector, by operation.",
            labelnames=[*names, "op"],
            buckets=list(pipeline.metrics.latency_buckets),
        )
        self.errors = self._counter_cls(
            "kvcompose_call_errors_total",
            "Calls into a child connector that raised, by operation and exception type.",
            labelnames=[*names, "op", "error_type"],
        )
        self.lookups = self._counter_cls(
            "kvcompose_lookups_total",
            "Lookups (get_num_new_matched_tokens) answered by each child, by result.",
            labelnames=[*names, "result"],
        )
        self.matched_tokens = self._counter_cls(
            "kvcompose_matched_tokens_total", "Tokens each child reported it holds for a request.", labelnames=names
        )
        self.loaded_tokens = self._counter_cls(
            "kvcompose_loaded_tokens_total", "Tokens each child was chosen to load.", labelnames=names
        )
        self.forgone_tokens = self._counter_cls(
            "kvcompose_tokens_forgone_total",
            "Tokens a child held beyond those the load policy loaded (from another child, or none): what "
            "longest_match would have loaded more.",
            labelnames=names,
        )
        self.load_error_blocks = self._counter_cls(
            "kvcompose_load_error_blocks_total",
            "Blocks each child failed to load (vLLM recomputes them).",
            labelnames=names,
        )
        info = self._gauge_cls(
            "kvcompose_pipeline_info",
            "The pipeline's children: 1 per child, with its position and class.",
            labelnames=[*labelnames, "pipeline", CONNECTOR_LABEL, "connector_class", "position"],
            multiprocess_mode="mostrecent",
        )
        self.child_state = self._gauge_cls(
            "kvcompose_child_state",
            "Each child's state: 0 closed (called), 1 open (skipped), 2 half-open (probing), the worst circuit "
            "breaker of the engine's scheduler and workers at their last report; 3 stuck, while a call into it "
            "runs past watchdog_s (read live).",
            labelnames=names,
            multiprocess_mode="mostrecent",
        )
        self.breaker_opens = self._counter_cls(
            "kvcompose_circuit_breaker_opens_total",
            "Times a child's circuit breaker opened after consecutive failures.",
            labelnames=names,
        )
        for engine_labels in per_engine_labelvalues.values():
            for spec in specs:
                info.labels(*engine_labels, pipeline.name, spec.name, spec.class_name, str(spec.index)).set(1)
                self.child_state.labels(*engine_labels, spec.name).set(0)
                # Each counter starts at 0, so its first increase shows in rate() and increase().
                for metric, extra_labels in _COUNTER_SERIES.values():
                    getattr(self, metric).labels(*engine_labels, spec.name, *extra_labels)
                self.load_error_blocks.labels(*engine_labels, spec.name)
        # (engine, child, op) -> how to add a cell to its histogram series: labels() costs more than that.
        self._duration_series: dict[tuple[int, str, str], CellAdder] = {}
        self._transfers = TransferSeries(metric_types, names, per_engine_labelvalues, [spec.name for spec in specs],
                                         [copy_source(spec.connector_cls) for spec in specs],
                                         pipeline.metrics.transfer_buckets)
        self.spans_dropped = self._counter_cls(
            "kvcompose_spans_dropped_total",
            "Spans kvcompose lost, by reason: queue_full (the collector is slow or unreachable), export_failed "
            "(the collector refused them), exporter_down (the exporter process died), shutdown (not exported "
            "within tracing.shutdown_flush_s).",
            labelnames=[*labelnames, "reason"],
        )
        self.spans_queued = self._gauge_cls(
            "kvcompose_spans_queued",
            "Spans waiting to be exported, in the fullest queue of the engine's processes (read live about "
            "every second; else at the engine's last stats).",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self.exporter_restarts = self._counter_cls(
            "kvcompose_exporter_restarts_total",
            "Span exporter processes started again after one died.",
            labelnames=labelnames,
        )
        for engine_labels in per_engine_labelvalues.values():
            for reason in DROP_REASONS:
                self.spans_dropped.labels(*engine_labels, reason)
            self.spans_queued.labels(*engine_labels).set(0)
            self.exporter_restarts.labels(*engine_labels)
        self._native = _NativeChildMetrics(children_metric_types, labelnames, per_engine_labelvalues, specs)
        # What engine processes publish while no stats flow (kvcompose.live): subscribe a key to set a gauge.
        self.live = LiveView(engine_ids(vllm_config, per_engine_labelvalues))
        self.live.subscribe(LIVE_SPANS_QUEUED, self._set_spans_queued)
        self._running_calls = RunningCallSeries(metric_types, names, per_engine_labelvalues,
                                                [spec.name for spec in specs], self.child_state)
        self._running_calls.subscribe(self.live)
        self.live.start()
        self._economics = EconomicsSeries(metric_types, labelnames, per_engine_labelvalues,
                                          [spec.name for spec in specs])
        self._routing = RoutingSeries(metric_types, labelnames, per_engine_labelvalues)
        self._tenants = (TenantSeries(metric_types, labelnames, per_engine_labelvalues, [spec.name for spec in specs])
                         if pipeline.tenants.top_k else None)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine_labels = self.per_engine_labelvalues[engine_idx]
        if (economics := transfer_stats_data.get(ECONOMICS_KEY)) is not None:  # first: a cost prices the loads
            self._economics.observe(EconomicsReport.from_payload(economics), engine_idx)
        if (calls := transfer_stats_data.get(CALLS_KEY)) is not None:
            self._observe_calls(CallTable.from_payload(calls), engine_idx)
        if (transfers := transfer_stats_data.get(TRANSFERS_KEY)) is not None:
            self._transfers.observe(TransferTable.from_payload(transfers), engine_idx)
        if (telemetry := transfer_stats_data.get(TELEMETRY_KEY)) is not None:
            self._observe_telemetry(TelemetryCounters.from_payload(telemetry), engine_idx)
        if (routing := transfer_stats_data.get(ROUTING_KEY)) is not None:
            self._routing.observe(RoutingReport.from_payload(routing), engine_idx)
        if self._tenants is not None and (tenants := transfer_stats_data.get(TENANTS_KEY)) is not None:
            # After the calls, at the cost they were priced at: the tenants' sums equal the pipeline's.
            self._tenants.observe(TenantReport.from_payload(tenants), engine_idx, self._economics.cost(engine_idx))
        for child, breaker in transfer_stats_data.get(BREAKERS_KEY, {}).items():
            self._running_calls.breaker_reported(engine_idx, child, breaker["state"])
            if breaker["opens"]:
                self.breaker_opens.labels(*engine_labels, child).inc(breaker["opens"])
        for child, entry in transfer_stats_data.get(NATIVE_KEY, {}).items():
            self._native.observe(child, entry, engine_idx)

    def _observe_calls(self, table: CallTable, engine_idx: int) -> None:
        engine_labels = self.per_engine_labelvalues[engine_idx]
        for cell, (count, seconds) in table.cells.items():
            key = (engine_idx, *table.operation_of(cell))
            if (add := self._duration_series.get(key)) is None:
                series = self.duration.labels(*engine_labels, *key[1:])
                add = self._duration_series[key] = cell_adder(series, self._latency_bounds)
            add(cell % table.buckets, count, seconds, None)
        for index, amount in enumerate(table.counters):
            if amount:
                row, column = divmod(index, len(COUNTERS))
                metric, extra_labels = _COUNTER_SERIES[COUNTERS[column]]
                getattr(self, metric).labels(*engine_labels, table.children[row], *extra_labels).inc(amount)
                if metric == "loaded_tokens":
                    self._economics.loaded(engine_idx, table.children[row], amount)
        for child in table.load_errors:
            if blocks := table.load_error_blocks(child):
                self.load_error_blocks.labels(*engine_labels, child).inc(blocks)
        for child, by_op in table.errors.items():
            for op, by_type in by_op.items():
                for error_type, count in by_type.items():
                    self.errors.labels(*engine_labels, child, op, error_type).inc(count)


    def _observe_telemetry(self, telemetry: TelemetryCounters, engine_idx: int) -> None:
        engine_labels = self.per_engine_labelvalues[engine_idx]
        for reason, spans in telemetry.dropped.items():
            self.spans_dropped.labels(*engine_labels, reason).inc(spans)
        if telemetry.exporter_restarts:
            self.exporter_restarts.labels(*engine_labels).inc(telemetry.exporter_restarts)
        if telemetry.spans_queued is not None and not self.live.publishing(engine_idx):
            self.spans_queued.labels(*engine_labels).set(telemetry.spans_queued)

    def _set_spans_queued(self, engine_idx: int, values: list[int]) -> None:
        self.spans_queued.labels(*self.per_engine_labelvalues[engine_idx]).set(max(values))


class _NativeChildMetrics:
    """Children's own KVConnectorPromMetrics, one per class, told apart by ``connector``."""

    def __init__(
        self,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        specs: list[ChildSpec],
    ) -> None:
        self._slot: dict[tuple[int, str], int] = {}  # (engine, child) -> synthetic engine index
        self._by_child: dict[str, KVConnectorPromMetrics] = {}
        by_class: dict[type, list[ChildSpec]] = {}
        for spec in specs:
            by_class.setdefault(spec.connector_cls, []).append(spec)
        for connector_cls, class_specs in by_class.items():
            labelvalues: dict[int, list[object]] = {}
            for engine_idx, engine_labels in per_engine_labelvalues.items():
                for spec in class_specs:
                    slot = len(self._slot)
                    self._slot[(engine_idx, spec.name)] = slot
                    labelvalues[slot] = [*engine_labels, spec.name]
            built = connector_cls.build_prom_metrics(
                class_specs[0].vllm_config, metric_types, [*labelnames, CONNECTOR_LABEL], labelvalues
            )
            if built is not None:
                for spec in class_specs:
                    self._by_child[spec.name] = built

    def observe(self, child: str, entry: Any, engine_idx: int) -> None:
        """The child's stats, as they crossed processes, into its metrics (as MultiConnector passes them)."""
        if (metrics := self._by_child.get(child)) is not None:
            metrics.observe(NativeStats.stats_data(entry), self._slot[(engine_idx, child)])
