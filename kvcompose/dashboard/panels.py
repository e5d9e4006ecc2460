"""Which panels the dashboard shows, grouped as the layout places them."""

from __future__ import annotations

import kvcompose.dashboard.queries as q
from kvcompose.dashboard.model import PanelSpec, State
from kvcompose.metrics.running_calls import STUCK

TOKENS_PER_SECOND = "count:tok/s"
REQUESTS_PER_SECOND = "count:req/s"
SECONDS_PER_SECOND = "count:s/s"  # engine seconds per second of wall time

OVERVIEW: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Pipeline topology",
        "The children of each pipeline in load order, from kvcompose_pipeline_info.",
        "none", (q.TOPOLOGY,), kind="table", width=24, height=6,
        columns=("position", "connector", "connector_class", "pipeline"),
    ),
    PanelSpec(
        "Lookup hit ratio",
        "Per child: the share of requests in which the child held tokens of the prompt beyond the GPU prefix "
        "cache's, each request counted once, at its first admission (kvcompose_lookups_total). The series 'all children, tokens (vLLM)' "
        "is vLLM's own ratio, which counts tokens over all children together: tokens loaded from any child over "
        "the prompt tokens the GPU prefix cache did not hold (vllm:external_prefix_cache_hits_total / "
        "_queries_total; preempted requests left out). A child that holds short prefixes of many prompts reads "
        "high here and adds little to vLLM's ratio.",
        "percentunit", (q.LOOKUP_HIT_RATIO, q.VLLM_EXTERNAL_HIT_RATIO), min=0, max=1,
    ),
    PanelSpec(
        "Tokens served",
        "loaded: tokens the child was chosen to load; held: tokens it reported holding at lookup. Summed over the "
        "children, loaded equals vLLM's external prefix cache hits (all children (vLLM)).",
        TOKENS_PER_SECOND, (q.LOADED_TOKENS, q.MATCHED_TOKENS, q.VLLM_EXTERNAL_HITS), min=0,
    ),
)

CHILD_CALLS: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Call latency p50 / p90 / p99",
        "Latency of every call kvcompose made into the child, by operation (the $op variable filters them).",
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
)

LIVE_HEALTH: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Child state",
        "kvcompose_child_state: closed (calls go through), open (child skipped), half-open (probing) from the "
        "circuit breaker; stuck while a call into the child has run past the pipeline's watchdog_s. Stuck is read "
        "live: vLLM sends no stats while its engine thread waits in the call, and /health still answers.",
        "none", (q.CHILD_STATE,), kind="state-timeline", width=16, height=6,
        states=(State(0, "closed", "green"), State(1, "open", "red"), State(2, "half-open", "orange"),
                State(STUCK, "stuck", "purple")),
    ),
    PanelSpec(
        "Circuit breaker opens",
        "Times the child's breaker opened: shows flapping that the state panel, sampled at each scrape, can miss.",
        "count:opens/s", (q.BREAKER_OPENS,), width=8, height=6, min=0, no_value="never opened",
    ),
    PanelSpec(
        "Calls running long",
        "How long the oldest running call into the child, by operation, has been running, while one runs long "
        "(the engine's watchdog looks every 0.25 s; kvcompose_calls_in_progress_seconds). 0 once it returns.",
        "s", (q.CALLS_IN_PROGRESS,), width=12, min=0, no_value="no call running long",
    ),
    PanelSpec(
        "Spans dropped by reason",
        "Spans kvcompose lost, per second: queue_full (collector slow or unreachable), export_failed (collector "
        "refused them), exporter_down (an exporter process died), shutdown (not exported in "
        "tracing.shutdown_flush_s).",
        "count:spans/s", (q.SPANS_DROPPED,), width=12, min=0,
    ),
    PanelSpec(
        "Spans waiting for export",
        "Spans queued for export in the fullest queue of the engine's processes (kvcompose_spans_queued).",
        "short", (q.SPANS_QUEUED,), width=12, min=0,
    ),
    PanelSpec(
        "Span exporter restarts",
        "Exporter processes started again after one died (kvcompose_exporter_restarts_total).",
        "count:restarts/s", (q.EXPORTER_RESTARTS,), width=12, min=0,
    ),
)

TRANSFERS: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Copy time p50 / p99",
        "Time the child spent moving each transfer's bytes (kvcompose_transfer_copy_seconds): its own measurement "
        "where it reports one (OffloadingConnector's job results, NIXL's telemetry: source=child), else the time "
        "inside kvcompose's calls into it that moved them (source=calls). How fast the tier is.",
        "s", q.COPY_LATENCY, min=0,
    ),
    PanelSpec(
        "Copy throughput",
        "Bytes the child moved per second of copy time: the tier's bandwidth while it copies.",
        "Bps", (q.COPY_THROUGHPUT,), min=0,
    ),
    PanelSpec(
        "Transfer lifetime p50 / p99",
        "From the step that issues a transfer until the engine learns it ended (kvcompose_transfer_lifetime_seconds): "
        "for a load, what the request waits; for a save, how long its blocks stay held. It includes the steps "
        "between the copy's end and the poll that notices it. The dots are exemplars: a recent traced transfer of "
        "that lifetime; open its trace in Jaeger from the dot (Prometheus must scrape /metrics/ with exemplar "
        "storage on; see docs/metrics.md).",
        "s", q.LIFETIME, min=0,
    ),
    PanelSpec(
        "Engine wait",
        "Seconds per second the forward pass spent inside the child's blocking calls (start_load_kv, "
        "wait_for_layer_load: load; save_kv_layer, wait_for_save: save): how much this tier slows every request.",
        SECONDS_PER_SECOND, (q.ENGINE_WAIT,), min=0,
    ),
    PanelSpec(
        "Bytes moved", "Bytes of KV the child's transfers moved per second.", "Bps", (q.TRANSFER_BYTES,), width=8,
        min=0,
    ),
    PanelSpec(
        "Transfers in flight", "The child's transfers started and not yet ended.", "short",
        (q.TRANSFERS_IN_FLIGHT,), width=8, min=0,
    ),
    PanelSpec(
        "Transfer failures", "The child's transfers that failed or were aborted, per second.", "ops",
        (q.TRANSFER_FAILURES,), width=8, min=0,
    ),
)

TIER_ECONOMICS: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Hit ratio by cache size",
        "Estimated share of prefix-block references an LRU cache of each size would serve on the engine's recent "
        "traffic (kvcompose_cache_size_hit_ratio, SHARDS sampling, one-hour half-life). Marked: the GPU cache's "
        "size G and, for each tier of T blocks, G + T: under vLLM's chained prefix hashes the GPU cache and a tier "
        "below it act as one LRU cache, so the tier adds about hit(G + T) - hit(G). With prefix caching off the "
        "GPU cache serves no prefix hits: G is 0 (its capacity reads 0), it has no mark and a tier's mark is T. "
        "A tier of unknown size has no mark. A tier several engines share sees all their traffic: read the "
        "curves of every engine together. Sizes in GiB: panel Tier capacity.",
        "percentunit", (q.HIT_RATIO_BY_SIZE, q.CAPACITY_MARKS), kind="xychart", width=16, height=10,
        x_field="size_blocks", x_label="cache size (blocks)",
    ),
    PanelSpec(
        "Tier capacity",
        "Each tier's capacity where kvcompose knows it (OffloadingConnector's cpu_bytes_to_use) and the GPU "
        "cache's (gpu; 0 with prefix caching off, as it then serves no prefix hits), in bytes: "
        "kvcompose_tier_capacity_blocks times kvcompose_kv_block_bytes.",
        "bytes", (q.TIER_CAPACITY_BYTES,), kind="stat", width=8, height=10, no_value="no size known",
    ),
    PanelSpec(
        "Prefill saved and net value",
        "saved: prefill seconds per second the child's loads spared the engine (tokens loaded times the fitted "
        "prefill cost per token; 0 until that cost is known, and then not judged). net: saved less the engine "
        "wait of its loads; below 0 the tier costs more than recomputing (alert KVComposeTierNetNegative).",
        SECONDS_PER_SECOND, (q.PREFILL_SAVED, q.NET_VALUE),
    ),
    PanelSpec(
        "Prefill cost per token",
        "The engine's marginal cost of prefilling a token (kvcompose_prefill_seconds_per_token), fitted online to "
        "its steps' forward time as a fixed cost per step plus a cost per prefill token and per decode token: "
        "the price of a token that is recomputed instead of loaded. No value until the steps' prefill sizes vary "
        "enough to fit it.",
        "s", (q.PREFILL_COST,), min=0,
    ),
    PanelSpec(
        "Write waste",
        "Estimated share of the blocks saved to each tier that no later request reads from it at its current "
        "size: never reused, or reused only after the tier evicted them (kvcompose_write_waste_ratio).",
        "percentunit", (q.WRITE_WASTE,), min=0, max=1, no_value="no tier of known size loads",
    ),
    PanelSpec(
        "Tokens forgone",
        "Tokens a child held beyond those the load policy loaded (from another child, or none): what "
        "longest_match would have loaded more than first_match (kvcompose_tokens_forgone_total).",
        TOKENS_PER_SECOND, (q.TOKENS_FORGONE,), min=0,
    ),
)

ROUTING: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Router predictions",
        "Finished requests per second whose router sent a valid prediction of the prompt tokens this engine held "
        "(kv_transfer_params kvcompose.predicted_cached_tokens, or the x-kvcompose-predicted-cached-tokens header "
        "under kvcompose serve; kvcompose_router_predictions_total).",
        REQUESTS_PER_SECOND, (q.ROUTER_PREDICTIONS,), width=6, min=0,
    ),
    PanelSpec(
        "Over- and under-prediction",
        "Of the prompt tokens routers predicted this engine held: over, the share that was not there (each "
        "request's max(predicted - reused, 0)); under, reused tokens beyond the prediction, in the same unit (it "
        "can exceed 1). Over-prediction means a stale router index or tier weights set too high: alert "
        "KVComposeRouterOverpredicting.",
        "percentunit", (q.ROUTER_OVERPREDICTED_SHARE, q.ROUTER_UNDERPREDICTED_SHARE), width=6, min=0,
    ),
    PanelSpec(
        "Invalid predictions",
        "Requests per second whose prediction was not an integer from 0 to the prompt's length: counted, ignored "
        "(kvcompose_router_predictions_invalid_total). Many mean a router or proxy sends something other than a token count.",
        REQUESTS_PER_SECOND, (q.ROUTER_INVALID,), width=6, min=0,
    ),
    PanelSpec(
        "Reused vs predicted tokens",
        "predicted: prompt tokens routers predicted this engine held; reused: the tokens those requests reused, "
        "GPU prefix cache plus loads (failed loads excluded); both per second, over requests with a valid "
        "prediction.",
        TOKENS_PER_SECOND, (q.ROUTER_PREDICTED_TOKENS, q.ROUTER_REUSED_TOKENS), width=6, min=0,
    ),
)

TENANTS: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Prompt tokens by tenant",
        "Prompt tokens per second of the requests each engine admitted, by tenant: the top tenants.top_k by "
        "prompt tokens over the last hour have their own label, every other tenant is 'other', requests "
        "without a tenant 'none', unusable tenant values 'invalid' (kvcompose_tenant_prompt_tokens_total). A "
        "tenant that leaves the top is folded into 'other', which then steps up once.",
        TOKENS_PER_SECOND, (q.TENANT_PROMPT_TOKENS,), min=0,
    ),
    PanelSpec(
        "Tokens served by tier and tenant",
        "Tokens each tier was chosen to load per second, by tenant (kvcompose_tenant_loaded_tokens_total): "
        "who each tier actually serves. Summed over tenants, a tier's loaded tokens.",
        TOKENS_PER_SECOND, (q.TENANT_LOADED_TOKENS,), min=0,
    ),
    PanelSpec(
        "Prefill saved by tier and tenant",
        "Prefill seconds per second each tier's loads spared the engine, by tenant: the tenant's loaded tokens "
        "times the engine's fitted prefill cost per token (kvcompose_tenant_prefill_seconds_saved_total). "
        "Whose reuse pays for the tier.",
        SECONDS_PER_SECOND, (q.TENANT_PREFILL_SAVED,), min=0,
    ),
    PanelSpec(
        "Tenant hit ratio at the GPU cache's size",
        "Estimated share of each tenant's prompt blocks an LRU prefix cache of the GPU cache's size, shared by "
        "every tenant, would serve (kvcompose_tenant_cache_size_hit_ratio from the engine's one SHARDS "
        "sampler). A tenant well below the engine-wide curve at that size is crowded out by the others; "
        "kvcompose advise --by-tenant reads it at each tier's size too. No value with prefix caching off.",
        "percentunit", (q.TENANT_HIT_RATIO_AT_GPU,), min=0, max=1,
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
