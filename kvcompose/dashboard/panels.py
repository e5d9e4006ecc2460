"""Which panels the dashboard shows, grouped as the layout places them."""

from __future__ import annotations

from kvcompose.dashboard import queries as q
from kvcompose.dashboard.model import PanelSpec, State

TOKENS_PER_SECOND = "count:tok/s"

OVERVIEW: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Pipeline topology",
        "The children of each pipeline in load order, from kvcompose_pipeline_info.",
        "none", (q.TOPOLOGY,), kind="table", width=24, height=6,
        columns=("position", "connector", "connector_class", "pipeline"),
    ),
    PanelSpec(
        "Lookup hit ratio",
        "Share of lookups (get_num_new_matched_tokens) in which the child held tokens of the request.",
        "percentunit", (q.LOOKUP_HIT_RATIO,), min=0, max=1,
    ),
    PanelSpec(
        "Tokens served",
        "loaded: tokens the child was chosen to load; held: tokens it reported holding at lookup.",
        TOKENS_PER_SECOND, (q.LOADED_TOKENS, q.MATCHED_TOKENS), min=0,
    ),
)

CHILD_CALLS: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Call latency p50 / p90 / p99",
        "Latency of kvcompose's calls into the child, by operation (the $op variable filters them): a sample, "
        "one call in metrics.sample_every (32), each standing for the calls before it.",
        "s", q.LATENCY, min=0,
    ),
    PanelSpec("Call rate", "Calls into the child per second, by operation.", "ops", (q.CALL_RATE,), min=0),
    PanelSpec(
        "Call errors",
        "Calls into the child that raised, by operation and exception type.",
        "ops", (q.ERROR_RATE,), min=0, no_value="no errors",
    ),
    PanelSpec(
        "Blocks that failed to load",
        "Blocks the child failed to load: vLLM recomputes them under kv_load_failure_policy 'recompute' "
        "and fails the request under 'fail' (its default).",
        "count:blocks/s", (q.LOAD_ERROR_BLOCKS,), min=0,
    ),
    PanelSpec(
        "Circuit breaker state",
        "kvcompose_child_state: closed (calls go through), open (child skipped), half-open (probing).",
        "none", (q.CHILD_STATE,), kind="state-timeline", width=16, height=6,
        states=(State(0, "closed", "green"), State(1, "open", "red"), State(2, "half-open", "orange")),
    ),
    PanelSpec(
        "Circuit breaker opens",
        "Times the child's breaker opened: shows flapping that the state panel, sampled at each scrape, can miss.",
        "count:opens/s", (q.BREAKER_OPENS,), width=8, height=6, min=0, no_value="never opened",
    ),
)

TRANSFERS: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Transfer duration p50 / p99",
        "Duration of the child's KV loads and saves, start to end. The dots are exemplars: a recent traced "
        "transfer of that duration; open its trace in Jaeger from the dot (Prometheus must scrape /metrics/ "
        "with exemplar storage on; see the README).",
        "s", q.TRANSFER_LATENCY, min=0,
    ),
    PanelSpec(
        "Transfer throughput", "Bytes of KV the child's transfers moved per second.", "Bps", (q.TRANSFER_BYTES,),
        min=0,
    ),
    PanelSpec(
        "Transfers in flight", "The child's transfers started and not yet ended.", "short",
        (q.TRANSFERS_IN_FLIGHT,), min=0,
    ),
    PanelSpec(
        "Transfer failures", "The child's transfers that failed or were aborted, per second.", "ops",
        (q.TRANSFER_FAILURES,), min=0,
    ),
)

OFFLOADING: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Offload transfer rate",
        "Bytes moved between GPU and the offload medium per second (vllm:kv_offload_*_bytes).",
        "Bps", (q.OFFLOAD_LOAD_BYTES, q.OFFLOAD_STORE_BYTES), min=0, no_value="no OffloadingConnector child",
    ),
    PanelSpec(
        "Offload bandwidth while transferring",
        "Bytes per second of transfer time (vllm:kv_offload_*_bytes over vllm:kv_offload_*_time).",
        "Bps", (q.OFFLOAD_LOAD_BANDWIDTH, q.OFFLOAD_STORE_BANDWIDTH), min=0, no_value="no OffloadingConnector child",
    ),
    PanelSpec(
        "Offload lookup latency p99",
        "Time of one offload lookup call (vllm:kv_offload_lookup_sync_delay_seconds).",
        "s", (q.OFFLOAD_LOOKUP_P99,), width=8, min=0, no_value="no OffloadingConnector child",
    ),
    PanelSpec(
        "CPU offload space pinned by transfers",
        "Fraction of the CPU KV space pinned by in-flight transfers (vllm:kv_offload_cpu_cache_usage_perc).",
        "percentunit", (q.OFFLOAD_CPU_USAGE,), width=8, min=0, max=1, no_value="no CPU offloading child",
    ),
    PanelSpec(
        "Offload store allocation failures",
        "Store allocations in the offload medium that failed (vllm:kv_offload_allocation_failure).",
        "ops", (q.OFFLOAD_ALLOCATION_FAILURES,), width=8, min=0, no_value="no OffloadingConnector child",
    ),
)

NIXL: tuple[PanelSpec, ...] = (
    PanelSpec(
        "NIXL transfer time p50 / p99",
        "Duration of NIXL KV transfers (vllm:nixl_xfer_time_seconds).",
        "s", q.NIXL_TRANSFER_TIME, width=8, min=0, no_value="no NIXL child",
    ),
    PanelSpec(
        "NIXL transfer rate",
        "Bytes transferred by NIXL per second (vllm:nixl_bytes_transferred).",
        "Bps", (q.NIXL_BYTES,), width=8, min=0, no_value="no NIXL child",
    ),
    PanelSpec(
        "NIXL failures",
        "Failed transfers (handshakes and notifications included) and requests whose KV expired.",
        "ops", (q.NIXL_FAILED_TRANSFERS, q.NIXL_EXPIRED_REQUESTS), width=8, min=0, no_value="no NIXL child",
    ),
)

# Children whose own metrics have panels, by the connector names vLLM registers.
NATIVE_PANELS: dict[str, tuple[PanelSpec, ...]] = {
    "OffloadingConnector": OFFLOADING,
    "NixlConnector": NIXL,
    "NixlPullConnector": NIXL,
    "NixlPushConnector": NIXL,
}
