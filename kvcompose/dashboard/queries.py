"""The PromQL behind every dashboard panel.

Each query is built for a :class:`Scope`: the dashboard's template variables
(``$model_name``, ``$engine``, ``$connector``), plus ``connector="<child>"``
in a child's own row of a pipeline dashboard (the variable still applies
there, so deselecting a child empties its row). Rates use Grafana's
``$__rate_interval``, which never drops below four scrape intervals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

RATE_INTERVAL = "$__rate_interval"
VARIABLE_MATCHERS = ('model_name=~"$model_name"', 'engine=~"$engine"', 'connector=~"$connector"')
OP_MATCHER = 'op=~"$op"'
HIT_MATCHER = 'result="hit"'


@dataclass(frozen=True)
class Scope:
    """The children a query covers: all that ``$connector`` selects, or one of them."""

    child: str | None = None

    @property
    def matchers(self) -> tuple[str, ...]:
        own = (f'connector="{self.child}"',) if self.child else ()
        return (*VARIABLE_MATCHERS, *own)


def selector(metric: str, scope: Scope, *extra: str) -> str:
    return f"{metric}{{{', '.join((*scope.matchers, *extra))}}}"


def _rate(metric: str, scope: Scope, *extra: str) -> str:
    return f"rate({selector(metric, scope, *extra)}[{RATE_INTERVAL}])"


def _sum_rate(by: str, metric: str, scope: Scope, *extra: str) -> str:
    return f"sum by ({by}) ({_rate(metric, scope, *extra)})"


def _quantile(q: float, histogram: str, by: str, scope: Scope, *extra: str) -> str:
    return f"histogram_quantile({q}, {_sum_rate(f'le, {by}', f'{histogram}_bucket', scope, *extra)})"


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
    lambda s: f"max by (pipeline, position, connector, connector_class) ({selector('kvcompose_pipeline_info', s)})",
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
# Circuit-breaker state per child (0 closed, 1 open, 2 half-open).
CHILD_STATE = Query(
    "child_state", "{{connector}}", lambda s: f"max by (connector) ({selector('kvcompose_child_state', s)})"
)
BREAKER_OPENS = Query(
    "breaker_opens", "{{connector}}", lambda s: _sum_rate("connector", "kvcompose_circuit_breaker_opens_total", s)
)

# Each child's transfers (kvcompose/metrics/transfer_series.py), by direction (load, save).
TRANSFER_LATENCY = _quantiles(
    "transfer", "kvcompose_transfer_lifetime_seconds", "connector, direction", (0.5, 0.99), exemplars=True
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
    lambda s: f"max by (connector) ({selector('vllm:kv_offload_cpu_cache_usage_perc', s)})",
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
    LOAD_ERROR_BLOCKS, CHILD_STATE, BREAKER_OPENS,
    *TRANSFER_LATENCY, TRANSFER_BYTES, TRANSFERS_IN_FLIGHT, TRANSFER_FAILURES,
    OFFLOAD_LOAD_BYTES, OFFLOAD_STORE_BYTES, OFFLOAD_LOAD_BANDWIDTH, OFFLOAD_STORE_BANDWIDTH,
    OFFLOAD_LOOKUP_P99, OFFLOAD_CPU_USAGE, OFFLOAD_ALLOCATION_FAILURES,
    *NIXL_TRANSFER_TIME, NIXL_BYTES, NIXL_FAILED_TRANSFERS, NIXL_EXPIRED_REQUESTS,
)  # fmt: skip
