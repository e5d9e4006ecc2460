"""The PromQL behind every dashboard panel.

Each query is built for a :class:`Scope`: the dashboard's template variables
(``$model_name``, ``$engine``, ``$connector``), plus ``connector="<child>"``
in a child's own row of a pipeline dashboard (the variable still applies
there, so deselecting a child empties its row). Series of the whole engine
(the hit-ratio curve, span export, vLLM's own prefix-cache counters) carry no
``connector`` and are selected by model and engine only. Rates use Grafana's
``$__rate_interval``, which never drops below four scrape intervals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvcompose.wire.economics import GPU

RATE_INTERVAL = "$__rate_interval"
ENGINE_MATCHERS = ('model_name=~"$model_name"', 'engine=~"$engine"')
VARIABLE_MATCHERS = (*ENGINE_MATCHERS, 'connector=~"$connector"')
OP_MATCHER = 'op=~"$op"'
HIT_MATCHER = 'result="hit"'
LOAD_MATCHER = 'direction="load"'
GPU_MATCHER = f'connector="{GPU}"'
TIER_MATCHER = f'connector!="{GPU}"'
# Series of the whole engine: no `connector` label, so $connector does not filter them.
ENGINE_SERIES = frozenset({
    "kvcompose_cache_size_hit_ratio", "kvcompose_kv_block_bytes", "kvcompose_prefill_seconds_per_token",
    "kvcompose_spans_dropped_total", "kvcompose_spans_queued", "kvcompose_exporter_restarts_total",
    "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total",
    "kvcompose_router_predictions_total", "kvcompose_router_predicted_tokens_total",
    "kvcompose_router_reused_tokens_total", "kvcompose_router_overpredicted_tokens_total",
    "kvcompose_router_underpredicted_tokens_total", "kvcompose_router_predictions_invalid_total",
    "kvcompose_tenant_prompt_tokens_total", "kvcompose_tenant_cache_size_hit_ratio",
})


@dataclass(frozen=True)
class Scope:
    """The children a query covers: all that ``$connector`` selects, or one of them."""

    child: str | None = None

    @property
    def matchers(self) -> tuple[str, ...]:
        own = (f'connector="{self.child}"',) if self.child else ()
        return (*VARIABLE_MATCHERS, *own)


def selector(metric: str, scope: Scope, *extra: str) -> str:
    matchers = ENGINE_MATCHERS if metric in ENGINE_SERIES else scope.matchers
    return f"{metric}{{{', '.join((*matchers, *extra))}}}"


def engine_selector(metric: str, *extra: str) -> str:
    """A series of the engine, or one of its values that no child selection hides (the GPU cache's capacity)."""
    return f"{metric}{{{', '.join((*ENGINE_MATCHERS, *extra))}}}"


def _rate(metric: str, scope: Scope, *extra: str) -> str:
    return f"rate({selector(metric, scope, *extra)}[{RATE_INTERVAL}])"


def _sum_rate(by: str, metric: str, scope: Scope, *extra: str) -> str:
    return f"sum by ({by}) ({_rate(metric, scope, *extra)})"


def _engine_rate(metric: str, scope: Scope) -> str:
    """The per-second increase of a series of the whole engine, one per model and engine."""
    return _sum_rate("model_name, engine", metric, scope)


def _max_by(by: str, metric: str, scope: Scope) -> str:
    return f"max by ({by}) ({selector(metric, scope)})"


def _quantile(q: float, histogram: str, by: str, scope: Scope, *extra: str) -> str:
    return f"histogram_quantile({q}, {_sum_rate(f'le, {by}', f'{histogram}_bucket', scope, *extra)})"


ENGINE_LEGEND = "{{model_name}} engine {{engine}}"


@dataclass(frozen=True)
class Query:
    """One panel target: a stable name (tests key known answers on it), its legend and PromQL."""

    name: str
    legend: str
    build: Callable[[Scope], str]
    table: bool = False  # an instant query shown as table rows
    exemplars: bool = False  # Grafana also asks Prometheus for the exemplars of the series read

    def expr(self, scope: Scope) -> str:
        return self.build(scope)


def _quantiles(
    name: str, histogram: str, by: str, quantiles: tuple[float, ...], *extra: str, exemplars: bool = False,
) -> tuple[Query, ...]:
    """One query per quantile (``<name>_p50``, ...), a series per value of the ``by`` labels."""
    legend = " ".join(f"{{{{{label}}}}}" for label in by.split(", "))
    return tuple(
        Query(f"{name}_p{round(q * 100)}", f"{legend} p{round(q * 100)}",
              lambda s, q=q: _quantile(q, histogram, by, s, *extra), exemplars=exemplars)
        for q in quantiles
    )


# kvcompose's own series (kvcompose/metrics/prometheus.py).
TOPOLOGY = Query(
    "topology", "",
    lambda s: _max_by("pipeline, position, connector, connector_class", "kvcompose_pipeline_info", s),
    table=True,
)
LOOKUP_HIT_RATIO = Query(
    "lookup_hit_ratio", "{{connector}}",
    lambda s: f"{_sum_rate('connector', 'kvcompose_lookups_total', s, HIT_MATCHER)}"
              f" / {_sum_rate('connector', 'kvcompose_lookups_total', s)}",
)
LOADED_TOKENS = Query(
    "loaded_tokens", "{{connector}} loaded", lambda s: _sum_rate("connector", "kvcompose_loaded_tokens_total", s)
)
MATCHED_TOKENS = Query(
    "matched_tokens", "{{connector}} held", lambda s: _sum_rate("connector", "kvcompose_matched_tokens_total", s)
)
LATENCY = _quantiles("latency", "kvcompose_call_duration_seconds", "connector, op", (0.5, 0.9, 0.99), OP_MATCHER)
CALL_RATE = Query(
    "call_rate", "{{connector}} {{op}}",
    lambda s: _sum_rate("connector, op", "kvcompose_call_duration_seconds_count", s, OP_MATCHER),
)
ERROR_RATE = Query(
    "error_rate", "{{connector}} {{op}} {{error_type}}",
    lambda s: _sum_rate("connector, op, error_type", "kvcompose_call_errors_total", s, OP_MATCHER),
)
LOAD_ERROR_BLOCKS = Query(
    "load_error_blocks", "{{connector}}", lambda s: _sum_rate("connector", "kvcompose_load_error_blocks_total", s)
)

# vLLM's own prefix-cache counters for external (connector) hits, in tokens, over all children together
# (vllm/v1/metrics/loggers.py; counted at a request's first admission, vllm/v1/core/sched/scheduler.py).
VLLM_EXTERNAL_HITS = Query(
    "vllm_external_hits", "all children (vLLM)",
    lambda s: f"sum ({_rate('vllm:external_prefix_cache_hits_total', s)})",
)
VLLM_EXTERNAL_HIT_RATIO = Query(
    "vllm_external_hit_ratio", "all children, tokens (vLLM)",
    lambda s: f"sum ({_rate('vllm:external_prefix_cache_hits_total', s)})"
              f" / sum ({_rate('vllm:external_prefix_cache_queries_total', s)})",
)

# Live health: each child's state (0 closed, 1 open, 2 half-open, 3 stuck), calls running long, span export.
CHILD_STATE = Query(
    "child_state", "{{connector}}", lambda s: _max_by("connector", "kvcompose_child_state", s)
)
BREAKER_OPENS = Query(
    "breaker_opens", "{{connector}}", lambda s: _sum_rate("connector", "kvcompose_circuit_breaker_opens_total", s)
)
CALLS_IN_PROGRESS = Query(
    "calls_in_progress", "{{connector}} {{op}}",
    lambda s: _max_by("connector, op", "kvcompose_calls_in_progress_seconds", s),
)
SPANS_DROPPED = Query(
    "spans_dropped", "{{reason}}", lambda s: _sum_rate("reason", "kvcompose_spans_dropped_total", s)
)
SPANS_QUEUED = Query(
    "spans_queued", ENGINE_LEGEND,
    lambda s: _max_by("model_name, engine", "kvcompose_spans_queued", s),
)
EXPORTER_RESTARTS = Query(
    "exporter_restarts", ENGINE_LEGEND, lambda s: _engine_rate("kvcompose_exporter_restarts_total", s),
)

# Each child's transfers (kvcompose/metrics/transfer_series.py), by direction (load, save): the three times
# (kvcompose/instrumentation/transfers.py) and what moved. Throughput is the bytes of the transfers with a copy time
# over their copy seconds: a transfer without a copy time (see kvcompose_transfer_copy_seconds) is in neither.
COPY_LATENCY = _quantiles("copy", "kvcompose_transfer_copy_seconds", "connector, direction", (0.5, 0.99))
COPY_THROUGHPUT = Query(
    "copy_throughput", "{{connector}} {{direction}}",
    lambda s: f"{_sum_rate('connector, direction', 'kvcompose_transfer_copied_bytes_total', s)}"
              f" / {_sum_rate('connector, direction', 'kvcompose_transfer_copy_seconds_sum', s)}",
)
LIFETIME = _quantiles(
    "lifetime", "kvcompose_transfer_lifetime_seconds", "connector, direction", (0.5, 0.99), exemplars=True
)
ENGINE_WAIT = Query(
    "engine_wait", "{{connector}} {{direction}}",
    lambda s: _sum_rate("connector, direction", "kvcompose_engine_wait_seconds_total", s),
)
TRANSFER_BYTES = Query(
    "transfer_bytes", "{{connector}} {{direction}}",
    lambda s: _sum_rate("connector, direction", "kvcompose_transfer_bytes_total", s),
)
TRANSFERS_IN_FLIGHT = Query(
    "transfers_in_flight", "{{connector}} {{direction}}",
    lambda s: f"sum by (connector, direction) ({selector('kvcompose_transfers_in_flight', s)})",
)
TRANSFER_FAILURES = Query(
    "transfer_failures", "{{connector}} {{direction}} {{outcome}}",
    lambda s: _sum_rate("connector, direction, outcome", "kvcompose_transfers_failed_total", s),
)


# Tier economics (kvcompose/metrics/economics.py).
def _capacities(s: Scope) -> str:
    """Every tier's capacity in blocks that $connector selects, and the GPU cache's whatever it selects."""
    return (f"{selector('kvcompose_tier_capacity_blocks', s, TIER_MATCHER)}"
            f" or {engine_selector('kvcompose_tier_capacity_blocks', GPU_MATCHER)}")


def _capacity_marks(s: Scope) -> str:
    """The curve at the GPU cache's size G and at G + T for each tier of T blocks: a tier below the GPU cache
    serves the reuse distances in [G, G + T) (kvcompose/economics/sizes.py), and G + T is on the curve's grid.
    count_values turns each size into the size_blocks label the curve's points carry."""
    gpu = engine_selector("kvcompose_tier_capacity_blocks", GPU_MATCHER)
    reach_ends = (f"{selector('kvcompose_tier_capacity_blocks', s, TIER_MATCHER)}"
                  f" + ignoring (connector) group_left {gpu} or {gpu}")
    return (f"avg by (connector, size_blocks) ({selector('kvcompose_cache_size_hit_ratio', s)}"
            f' * ignoring (connector) group_right count_values without () ("size_blocks", {reach_ends}))')


HIT_RATIO_BY_SIZE = Query(
    "hit_ratio_by_size", "LRU hit ratio",
    lambda s: f"avg by (size_blocks) ({selector('kvcompose_cache_size_hit_ratio', s)})", table=True,
)
CAPACITY_MARKS = Query("capacity_marks", "GPU cache and tiers", _capacity_marks, table=True)
TIER_CAPACITY_BYTES = Query(
    "tier_capacity_bytes", "{{connector}}",
    lambda s: f"max by (connector) (({_capacities(s)})"
              f" * ignoring (connector) group_left {selector('kvcompose_kv_block_bytes', s)})",
)
PREFILL_SAVED = Query(
    "prefill_saved", "{{connector}} saved",
    lambda s: _sum_rate("connector", "kvcompose_prefill_seconds_saved_total", s),
)
NET_VALUE = Query(
    "net_value", "{{connector}} net",
    lambda s: f"{_sum_rate('connector', 'kvcompose_prefill_seconds_saved_total', s)}"
              f" - {_sum_rate('connector', 'kvcompose_engine_wait_seconds_total', s, LOAD_MATCHER)}",
)
PREFILL_COST = Query(
    "prefill_cost", "{{model_name}}",
    lambda s: f"avg by (model_name) ({selector('kvcompose_prefill_seconds_per_token', s)})",
)
WRITE_WASTE = Query(
    "write_waste", "{{connector}}", lambda s: _max_by("connector", "kvcompose_write_waste_ratio", s)
)
TOKENS_FORGONE = Query(
    "tokens_forgone", "{{connector}}", lambda s: _sum_rate("connector", "kvcompose_tokens_forgone_total", s)
)


# Routers' predictions of a request's cached prompt tokens, checked against what it reused
# (kvcompose/metrics/routing.py): series of the engine, one per model and engine.
def _share_of_predicted(metric: str, s: Scope) -> str:
    return f"{_engine_rate(metric, s)} / {_engine_rate('kvcompose_router_predicted_tokens_total', s)}"


ROUTER_PREDICTIONS = Query(
    "router_predictions", ENGINE_LEGEND, lambda s: _engine_rate("kvcompose_router_predictions_total", s)
)
ROUTER_OVERPREDICTED_SHARE = Query(
    "router_overpredicted_share", f"{ENGINE_LEGEND} over",
    lambda s: _share_of_predicted("kvcompose_router_overpredicted_tokens_total", s),
)
ROUTER_UNDERPREDICTED_SHARE = Query(
    "router_underpredicted_share", f"{ENGINE_LEGEND} under",
    lambda s: _share_of_predicted("kvcompose_router_underpredicted_tokens_total", s),
)
ROUTER_INVALID = Query(
    "router_invalid", ENGINE_LEGEND, lambda s: _engine_rate("kvcompose_router_predictions_invalid_total", s)
)
ROUTER_PREDICTED_TOKENS = Query(
    "router_predicted_tokens", f"{ENGINE_LEGEND} predicted",
    lambda s: _engine_rate("kvcompose_router_predicted_tokens_total", s),
)
ROUTER_REUSED_TOKENS = Query(
    "router_reused_tokens", f"{ENGINE_LEGEND} reused",
    lambda s: _engine_rate("kvcompose_router_reused_tokens_total", s),
)


# Tenants (kvcompose/metrics/tenants.py): the top tenants.top_k by prompt tokens, the rest as "other".
def _tenant_hit_ratio_at_gpu(s: Scope) -> str:
    """Each tenant's curve at its engine's GPU cache size: count_values turns the size into the size_blocks label
    the curve's points carry."""
    gpu = engine_selector("kvcompose_tier_capacity_blocks", GPU_MATCHER)
    return (f"avg by (tenant) ({selector('kvcompose_tenant_cache_size_hit_ratio', s)}"
            f' and on (model_name, engine, size_blocks) count_values without () ("size_blocks", {gpu}))')


TENANT_PROMPT_TOKENS = Query(
    "tenant_prompt_tokens", "{{tenant}}",
    lambda s: _sum_rate("tenant", "kvcompose_tenant_prompt_tokens_total", s),
)
TENANT_LOADED_TOKENS = Query(
    "tenant_loaded_tokens", "{{tenant}} from {{connector}}",
    lambda s: _sum_rate("tenant, connector", "kvcompose_tenant_loaded_tokens_total", s),
)
TENANT_PREFILL_SAVED = Query(
    "tenant_prefill_saved", "{{tenant}} by {{connector}}",
    lambda s: _sum_rate("tenant, connector", "kvcompose_tenant_prefill_seconds_saved_total", s),
)
TENANT_HIT_RATIO_AT_GPU = Query("tenant_hit_ratio_at_gpu", "{{tenant}}", _tenant_hit_ratio_at_gpu)

# OffloadingConnector's own series (vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py).
OFFLOAD_LOAD_BYTES = Query(
    "offload_load_bytes", "{{connector}} load", lambda s: _sum_rate("connector", "vllm:kv_offload_load_bytes_total", s)
)
OFFLOAD_STORE_BYTES = Query(
    "offload_store_bytes", "{{connector}} store",
    lambda s: _sum_rate("connector", "vllm:kv_offload_store_bytes_total", s),
)
OFFLOAD_LOAD_BANDWIDTH = Query(
    "offload_load_bandwidth", "{{connector}} load",
    lambda s: f"{_sum_rate('connector', 'vllm:kv_offload_load_bytes_total', s)}"
              f" / {_sum_rate('connector', 'vllm:kv_offload_load_time_total', s)}",
)
OFFLOAD_STORE_BANDWIDTH = Query(
    "offload_store_bandwidth", "{{connector}} store",
    lambda s: f"{_sum_rate('connector', 'vllm:kv_offload_store_bytes_total', s)}"
              f" / {_sum_rate('connector', 'vllm:kv_offload_store_time_total', s)}",
)
OFFLOAD_LOOKUP_P99 = Query(
    "offload_lookup_p99", "{{connector}} p99",
    lambda s: _quantile(0.99, "vllm:kv_offload_lookup_sync_delay_seconds", "connector", s),
)
OFFLOAD_CPU_USAGE = Query(
    "offload_cpu_usage", "{{connector}}",
    lambda s: _max_by("connector", "vllm:kv_offload_cpu_cache_usage_perc", s),
)
OFFLOAD_ALLOCATION_FAILURES = Query(
    "offload_allocation_failures", "{{connector}}",
    lambda s: _sum_rate("connector", "vllm:kv_offload_allocation_failure_total", s),
)

# NIXL's own series (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py).
NIXL_TRANSFER_TIME = _quantiles("nixl_transfer", "vllm:nixl_xfer_time_seconds", "connector", (0.5, 0.99))
NIXL_BYTES = Query(
    "nixl_bytes", "{{connector}}", lambda s: _sum_rate("connector", "vllm:nixl_bytes_transferred_sum", s)
)
NIXL_FAILED_TRANSFERS = Query(
    "nixl_failed_transfers", "{{connector}} failed transfers",
    lambda s: _sum_rate("connector", "vllm:nixl_num_failed_transfers_total", s),
)
NIXL_EXPIRED_REQUESTS = Query(
    "nixl_expired_requests", "{{connector}} expired requests",
    lambda s: _sum_rate("connector", "vllm:nixl_num_kv_expired_reqs_total", s),
)

QUERIES: tuple[Query, ...] = (
    TOPOLOGY, LOOKUP_HIT_RATIO, LOADED_TOKENS, MATCHED_TOKENS, *LATENCY, CALL_RATE, ERROR_RATE,
    LOAD_ERROR_BLOCKS, VLLM_EXTERNAL_HITS, VLLM_EXTERNAL_HIT_RATIO,
    CHILD_STATE, BREAKER_OPENS, CALLS_IN_PROGRESS, SPANS_DROPPED, SPANS_QUEUED, EXPORTER_RESTARTS,
    *COPY_LATENCY, COPY_THROUGHPUT, *LIFETIME, ENGINE_WAIT, TRANSFER_BYTES, TRANSFERS_IN_FLIGHT, TRANSFER_FAILURES,
    HIT_RATIO_BY_SIZE, CAPACITY_MARKS, TIER_CAPACITY_BYTES, PREFILL_SAVED, NET_VALUE, PREFILL_COST, WRITE_WASTE,
    TOKENS_FORGONE,
    ROUTER_PREDICTIONS, ROUTER_OVERPREDICTED_SHARE, ROUTER_UNDERPREDICTED_SHARE, ROUTER_INVALID,
    ROUTER_PREDICTED_TOKENS, ROUTER_REUSED_TOKENS,
    TENANT_PROMPT_TOKENS, TENANT_LOADED_TOKENS, TENANT_PREFILL_SAVED, TENANT_HIT_RATIO_AT_GPU,
    OFFLOAD_LOAD_BYTES, OFFLOAD_STORE_BYTES, OFFLOAD_LOAD_BANDWIDTH, OFFLOAD_STORE_BANDWIDTH,
    OFFLOAD_LOOKUP_P99, OFFLOAD_CPU_USAGE, OFFLOAD_ALLOCATION_FAILURES,
    *NIXL_TRANSFER_TIME, NIXL_BYTES, NIXL_FAILED_TRANSFERS, NIXL_EXPIRED_REQUESTS,
)  # fmt: skip
