"""Every PromQL expression of the dashboards, evaluated by `promtool test rules` with known answers.

The synthetic series below describe two children, "hot" and "cold", of model
"m" on engine "0", plus decoys the template variables must filter out: a
child "x" outside $connector, an engine "1", a model "other" and an
operation outside $op (the engine's own series, which carry no child, have
the engine and model decoys). Counters grow linearly, so every rate is exact: with
samples every 15 s and a 1 m window, rate = increment / 15 s. Histogram
buckets are powers of two, so every quantile is exact in binary floating
point too (promtool compares values exactly). The expected values are worked
out by hand next to each series.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcompose.dashboard import QUERIES

from .dashboard_support import (
    NATIVE_PIPELINE,
    dashboards,
    fill,
    label_values_parts,
    metrics_read,
    query_and_scope,
    targets,
    variable_queries,
)

STEP_S = 15
VALUES = {"model_name": "m", "engine": "0", "connector": "(hot|cold)", "op": "(lookup|start_load_kv)"}
RATE_INTERVAL = "1m"
EVAL_TIME = "10m"
SAMPLES = 40  # 10 m of 15 s steps
M = 'model_name="m", engine="0"'
OTHER_ENGINE = 'model_name="m", engine="1"'
OTHER_MODEL = 'model_name="other", engine="2"'


def counter(per_second: float) -> str:
    return f"0+{per_second * STEP_S}x{SAMPLES}"


def gauge(value: float) -> str:
    return f"{value}x{SAMPLES}"


def histogram(name: str, labels: str, per_second_by_le: Mapping[str, float]) -> list[tuple[str, str]]:
    """Cumulative bucket series (rates per second) and the matching _count."""
    series = [(f'{name}_bucket{{{labels}, le="{le}"}}', counter(rate)) for le, rate in per_second_by_le.items()]
    return [*series, (f"{name}_count{{{labels}}}", counter(per_second_by_le["+Inf"]))]


def info(labels: str, pipeline: str, child: str, position: int) -> tuple[str, str]:
    return (f'kvcompose_pipeline_info{{{labels}, pipeline="{pipeline}", connector="{child}", '
            f'connector_class="ExampleConnector", position="{position}"}}', gauge(1))


# The router prediction counters of engine "0", per second (kvcompose/metrics/routing.py).
ROUTER_RATES = {"predictions": 0.5, "predicted_tokens": 64, "reused_tokens": 48, "overpredicted_tokens": 24,
                "underpredicted_tokens": 8, "predictions_invalid": 0.25}

# Quartiles of one call per second: 1/4 under 0.25 s, 1/4 in (0.25, 0.5], 1/2 in (0.5, 1]:
# p50 = 0.25 + 0.25 * (0.5 - 0.25) / 0.25 = 0.5, p90 = 0.5 + 0.5 * (0.9 - 0.5) / 0.5 = 0.9, p99 = 0.99.
SPREAD = {"0.25": 0.25, "0.5": 0.5, "1": 1.0, "+Inf": 1.0}
# All calls under 0.25 s: the first bucket starts at 0, so p(q) = 0.25 * q: 0.125, 0.225, 0.2475.
FAST = {"0.25": 1.0, "0.5": 1.0, "1": 1.0, "+Inf": 1.0}
FAST_HALF = {le: rate / 2 for le, rate in FAST.items()}  # the same shape at 0.5 calls/s
SLOW = {"0.25": 0.0, "0.5": 0.0, "1": 1.0, "+Inf": 1.0}  # decoys: would move any quantile they leak into

HOT, COLD = f'{M}, connector="hot"', f'{M}, connector="cold"'
DECOYS = (f'{M}, connector="x"', f'{OTHER_ENGINE}, connector="hot"', f'{OTHER_MODEL}, connector="hot"')

SERIES: list[tuple[str, str]] = [
    info(M, "p", "hot", 0), info(M, "p", "cold", 1), info(M, "p", "x", 2),
    info(OTHER_ENGINE, "p", "hot", 0), info(OTHER_MODEL, "q", "hot", 0),
    # hit ratio: hot 0.75 / (0.75 + 0.25) = 0.75, cold 0.25 / (0.25 + 0.75) = 0.25
    (f'kvcompose_lookups_total{{{HOT}, result="hit"}}', counter(0.75)),
    (f'kvcompose_lookups_total{{{HOT}, result="miss"}}', counter(0.25)),
    (f'kvcompose_lookups_total{{{COLD}, result="hit"}}', counter(0.25)),
    (f'kvcompose_lookups_total{{{COLD}, result="miss"}}', counter(0.75)),
    (f"kvcompose_loaded_tokens_total{{{HOT}}}", counter(8)),
    (f"kvcompose_loaded_tokens_total{{{COLD}}}", counter(0)),
    (f"kvcompose_matched_tokens_total{{{HOT}}}", counter(16)),
    (f"kvcompose_matched_tokens_total{{{COLD}}}", counter(4)),
    *histogram("kvcompose_call_duration_seconds", f'{HOT}, op="lookup"', SPREAD),
    *histogram("kvcompose_call_duration_seconds", f'{HOT}, op="start_load_kv"', FAST_HALF),
    *histogram("kvcompose_call_duration_seconds", f'{HOT}, op="wait_for_save"', SLOW),  # outside $op
    *histogram("kvcompose_call_duration_seconds", f'{COLD}, op="lookup"', FAST),
    (f'kvcompose_call_errors_total{{{COLD}, op="lookup", error_type="OSError"}}', counter(0.25)),
    (f'kvcompose_call_errors_total{{{HOT}, op="start_load_kv", error_type="TimeoutError"}}', counter(0.5)),
    (f'kvcompose_call_errors_total{{{HOT}, op="wait_for_save", error_type="RuntimeError"}}', counter(1)),
    (f"kvcompose_load_error_blocks_total{{{HOT}}}", counter(0)),
    (f"kvcompose_load_error_blocks_total{{{COLD}}}", counter(2)),
    (f"kvcompose_child_state{{{HOT}}}", gauge(0)),
    (f"kvcompose_child_state{{{COLD}}}", gauge(2)),
    (f"kvcompose_circuit_breaker_opens_total{{{HOT}}}", counter(0)),
    (f"kvcompose_circuit_breaker_opens_total{{{COLD}}}", counter(0.25)),
    # Transfers: hot loads SPREAD and saves FAST, cold loads FAST_HALF (same quantiles as FAST);
    # cold saves nothing (no transfer series: none of its cells was ever used).
    *histogram("kvcompose_transfer_lifetime_seconds", f'{HOT}, direction="load"', SPREAD),
    *histogram("kvcompose_transfer_lifetime_seconds", f'{HOT}, direction="save"', FAST),
    *histogram("kvcompose_transfer_lifetime_seconds", f'{COLD}, direction="load"', FAST_HALF),
    # Copy times: shorter than the lifetimes (hot's loads FAST, not SPREAD); hot reports its own (source
    # "child"), cold's come from its calls. Throughput = bytes of the transfers with a copy time / copy seconds:
    # hot 512 / 0.25 = 2048 (load, of 1024 bytes in all), 512 / 0.25 = 2048 (save); cold 1024 / 0.5 = 2048 (of
    # 2048): all bytes over copy seconds would read 4096, 2048, 4096.
    *histogram("kvcompose_transfer_copy_seconds", f'{HOT}, direction="load", source="child"', FAST),
    *histogram("kvcompose_transfer_copy_seconds", f'{HOT}, direction="save", source="child"', FAST),
    *histogram("kvcompose_transfer_copy_seconds", f'{COLD}, direction="load", source="calls"', FAST_HALF),
    (f'kvcompose_transfer_copy_seconds_sum{{{HOT}, direction="load", source="child"}}', counter(0.25)),
    (f'kvcompose_transfer_copy_seconds_sum{{{HOT}, direction="save", source="child"}}', counter(0.25)),
    (f'kvcompose_transfer_copy_seconds_sum{{{COLD}, direction="load", source="calls"}}', counter(0.5)),
    # Engine wait, seconds per second; net value = saved - load wait: hot 0.75 - 0.5 = 0.25, cold 0 - 0.125.
    (f'kvcompose_engine_wait_seconds_total{{{HOT}, direction="load"}}', counter(0.5)),
    (f'kvcompose_engine_wait_seconds_total{{{HOT}, direction="save"}}', counter(0.25)),
    (f'kvcompose_engine_wait_seconds_total{{{COLD}, direction="load"}}', counter(0.125)),
    (f'kvcompose_transfer_bytes_total{{{HOT}, direction="load"}}', counter(1024)),
    (f'kvcompose_transfer_bytes_total{{{HOT}, direction="save"}}', counter(512)),
    (f'kvcompose_transfer_bytes_total{{{COLD}, direction="load"}}', counter(2048)),
    (f'kvcompose_transfer_copied_bytes_total{{{HOT}, direction="load", source="child"}}', counter(512)),
    (f'kvcompose_transfer_copied_bytes_total{{{HOT}, direction="save", source="child"}}', counter(512)),
    (f'kvcompose_transfer_copied_bytes_total{{{COLD}, direction="load", source="calls"}}', counter(1024)),
    (f'kvcompose_transfers_in_flight{{{HOT}, direction="load"}}', gauge(3)),
    (f'kvcompose_transfers_in_flight{{{HOT}, direction="save"}}', gauge(0)),
    (f'kvcompose_transfers_in_flight{{{COLD}, direction="load"}}', gauge(1)),
    (f'kvcompose_transfers_failed_total{{{HOT}, direction="load", outcome="failed"}}', counter(0.25)),
    (f'kvcompose_transfers_failed_total{{{HOT}, direction="save", outcome="failed"}}', counter(0)),
    (f'kvcompose_transfers_failed_total{{{COLD}, direction="load", outcome="aborted"}}', counter(0.5)),
    # Tier economics. The curve of engine "0": 256 -> 0.25, 512 -> 0.5, 1024 -> 0.625, 2048 -> 0.75 blocks.
    # The GPU cache holds 256 blocks, hot 768 (so it reaches to 256 + 768 = 1024 on the curve); cold's size
    # is unknown. A block is 2^20 bytes: hot holds 805306368 bytes, the GPU cache 268435456.
    *((f'kvcompose_cache_size_hit_ratio{{{M}, size_blocks="{size}"}}', gauge(ratio))
      for size, ratio in ((256, 0.25), (512, 0.5), (1024, 0.625), (2048, 0.75))),
    (f'kvcompose_tier_capacity_blocks{{{M}, connector="gpu"}}', gauge(256)),
    (f"kvcompose_tier_capacity_blocks{{{HOT}}}", gauge(768)),
    (f"kvcompose_kv_block_bytes{{{M}}}", gauge(2**20)),
    (f"kvcompose_prefill_seconds_per_token{{{M}}}", gauge(2**-11)),
    (f"kvcompose_prefill_seconds_saved_total{{{HOT}}}", counter(0.75)),
    (f"kvcompose_prefill_seconds_saved_total{{{COLD}}}", counter(0)),
    (f"kvcompose_write_waste_ratio{{{HOT}}}", gauge(0.25)),
    (f"kvcompose_write_waste_ratio{{{COLD}}}", gauge(0.5)),
    (f"kvcompose_tokens_forgone_total{{{HOT}}}", counter(0)),
    (f"kvcompose_tokens_forgone_total{{{COLD}}}", counter(4)),
    # Live health: hot's lookup has run 12 s; span export of engine "0".
    (f'kvcompose_calls_in_progress_seconds{{{HOT}, op="lookup"}}', gauge(12)),
    (f'kvcompose_calls_in_progress_seconds{{{COLD}, op="start_load_kv"}}', gauge(0)),
    *((f'kvcompose_spans_dropped_total{{{M}, reason="{reason}"}}', counter(rate))
      for reason, rate in (("queue_full", 0.5), ("export_failed", 0), ("exporter_down", 0.25), ("shutdown", 0))),
    (f"kvcompose_spans_queued{{{M}}}", gauge(40)),
    (f"kvcompose_exporter_restarts_total{{{M}}}", counter(0.25)),
    # vLLM's external prefix-cache counters, in tokens: 8 tok/s hit (hot's loads) of 32 tok/s queried.
    (f"vllm:external_prefix_cache_hits_total{{{M}}}", counter(8)),
    (f"vllm:external_prefix_cache_queries_total{{{M}}}", counter(32)),
    # Routers' predictions checked on engine "0": 0.5 predictions/s of 64 tok/s predicted, of which 24 tok/s were
    # not there (over: 24 / 64 = 0.375 of the predicted) while 8 tok/s were reused beyond the prediction (under:
    # 8 / 64 = 0.125), so 64 - 24 + 8 = 48 tok/s reused; 0.25 invalid predictions/s.
    *((f"kvcompose_router_{name}_total{{{M}}}", counter(rate)) for name, rate in ROUTER_RATES.items()),
    # OffloadingConnector on "hot": 1024 B/s loaded in 1/1024 s/s of transfer time = 2^20 B/s while
    # transferring; 512 B/s stored in the same time = 2^19 B/s.
    ("vllm:kv_offload_load_bytes_total{%s}" % HOT, counter(1024)),
    ("vllm:kv_offload_load_time_total{%s}" % HOT, counter(1 / 1024)),
    ("vllm:kv_offload_store_bytes_total{%s}" % HOT, counter(512)),
    ("vllm:kv_offload_store_time_total{%s}" % HOT, counter(1 / 1024)),
    *histogram("vllm:kv_offload_lookup_sync_delay_seconds", HOT, {"0.25": 1.0, "+Inf": 1.0}),
    ("vllm:kv_offload_cpu_cache_usage_perc{%s}" % HOT, gauge(0.5)),
    ("vllm:kv_offload_allocation_failure_total{%s}" % HOT, counter(0.25)),
    # NIXL on "cold".
    *histogram("vllm:nixl_xfer_time_seconds", COLD, SPREAD),
    ("vllm:nixl_bytes_transferred_sum{%s}" % COLD, counter(4096)),
    ("vllm:nixl_num_failed_transfers_total{%s}" % COLD, counter(0.25)),
    ("vllm:nixl_num_kv_expired_reqs_total{%s}" % COLD, counter(0.5)),
]
# Every decoy carries every metric, with values that would change any answer they leak into.
for decoy in DECOYS:
    SERIES += [
        (f'kvcompose_lookups_total{{{decoy}, result="hit"}}', counter(1)),
        (f"kvcompose_loaded_tokens_total{{{decoy}}}", counter(100)),
        (f"kvcompose_matched_tokens_total{{{decoy}}}", counter(100)),
        *histogram("kvcompose_call_duration_seconds", f'{decoy}, op="lookup"', SLOW),
        *histogram("kvcompose_call_duration_seconds", f'{decoy}, op="get_transfer_results"', SLOW),
        (f'kvcompose_call_errors_total{{{decoy}, op="lookup", error_type="OSError"}}', counter(1)),
        (f"kvcompose_load_error_blocks_total{{{decoy}}}", counter(1)),
        (f"kvcompose_child_state{{{decoy}}}", gauge(1)),
        (f"kvcompose_circuit_breaker_opens_total{{{decoy}}}", counter(1)),
        *histogram("kvcompose_transfer_lifetime_seconds", f'{decoy}, direction="load"', SLOW),
        (f'kvcompose_transfer_bytes_total{{{decoy}, direction="load"}}', counter(1)),
        (f'kvcompose_transfer_copied_bytes_total{{{decoy}, direction="load", source="calls"}}', counter(1)),
        (f'kvcompose_transfers_in_flight{{{decoy}, direction="load"}}', gauge(5)),
        (f'kvcompose_transfers_failed_total{{{decoy}, direction="load", outcome="failed"}}', counter(1)),
        *((f"vllm:kv_offload_{name}_total{{{decoy}}}", counter(1)) for name in (
            "load_bytes", "load_time", "store_bytes", "store_time", "allocation_failure")),
        *histogram("vllm:kv_offload_lookup_sync_delay_seconds", decoy, SLOW),
        (f"vllm:kv_offload_cpu_cache_usage_perc{{{decoy}}}", gauge(1)),
        *histogram("vllm:nixl_xfer_time_seconds", decoy, SLOW),
        (f"vllm:nixl_bytes_transferred_sum{{{decoy}}}", counter(1)),
        (f"vllm:nixl_num_failed_transfers_total{{{decoy}}}", counter(1)),
        (f"vllm:nixl_num_kv_expired_reqs_total{{{decoy}}}", counter(1)),
        *histogram("kvcompose_transfer_copy_seconds", f'{decoy}, direction="load", source="calls"', SLOW),
        (f'kvcompose_transfer_copy_seconds_sum{{{decoy}, direction="load", source="calls"}}', counter(1)),
        (f'kvcompose_engine_wait_seconds_total{{{decoy}, direction="load"}}', counter(1)),
        (f"kvcompose_tier_capacity_blocks{{{decoy}}}", gauge(1792)),  # would mark 256 + 1792 = 2048
        (f"kvcompose_prefill_seconds_saved_total{{{decoy}}}", counter(1)),
        (f"kvcompose_write_waste_ratio{{{decoy}}}", gauge(1)),
        (f"kvcompose_tokens_forgone_total{{{decoy}}}", counter(1)),
        (f'kvcompose_calls_in_progress_seconds{{{decoy}, op="lookup"}}', gauge(99)),
    ]
# Tenants: "a" and "other" (the rest). Tenant "a" reads 0.5 at the GPU cache's 256 blocks, "other" 0.125; both
# have points at sizes that are no GPU cache's (512), and the decoys' GPU caches (4096) would pick them.
SERIES += [
    (f'kvcompose_tenant_prompt_tokens_total{{{M}, tenant="a"}}', counter(100)),
    (f'kvcompose_tenant_prompt_tokens_total{{{M}, tenant="other"}}', counter(20)),
    (f'kvcompose_tenant_loaded_tokens_total{{{HOT}, tenant="a"}}', counter(6)),
    (f'kvcompose_tenant_loaded_tokens_total{{{COLD}, tenant="other"}}', counter(2)),
    (f'kvcompose_tenant_prefill_seconds_saved_total{{{HOT}, tenant="a"}}', counter(0.5)),
    (f'kvcompose_tenant_prefill_seconds_saved_total{{{COLD}, tenant="other"}}', counter(0.25)),
    *((f'kvcompose_tenant_cache_size_hit_ratio{{{M}, tenant="{tenant}", size_blocks="{size}"}}', gauge(ratio))
      for tenant, size, ratio in (("a", 256, 0.5), ("a", 512, 0.75), ("other", 256, 0.125), ("other", 4096, 1))),
]
for decoy in DECOYS:
    SERIES += [
        (f'kvcompose_tenant_loaded_tokens_total{{{decoy}, tenant="a"}}', counter(1)),
        (f'kvcompose_tenant_prefill_seconds_saved_total{{{decoy}, tenant="a"}}', counter(1)),
    ]
# The engine's own series (no child) of the other engine and model: values that would change any answer.
for decoy in (OTHER_ENGINE, OTHER_MODEL):
    SERIES += [
        (f'kvcompose_tenant_prompt_tokens_total{{{decoy}, tenant="a"}}', counter(1000)),
        (f'kvcompose_tenant_cache_size_hit_ratio{{{decoy}, tenant="a", size_blocks="4096"}}', gauge(1)),
        *((f'kvcompose_cache_size_hit_ratio{{{decoy}, size_blocks="{size}"}}', gauge(1)) for size in (256, 4096)),
        (f'kvcompose_tier_capacity_blocks{{{decoy}, connector="gpu"}}', gauge(4096)),
        (f"kvcompose_kv_block_bytes{{{decoy}}}", gauge(1)),
        (f"kvcompose_prefill_seconds_per_token{{{decoy}}}", gauge(1)),
        (f'kvcompose_spans_dropped_total{{{decoy}, reason="queue_full"}}', counter(1)),
        (f"kvcompose_spans_queued{{{decoy}}}", gauge(1000)),
        (f"kvcompose_exporter_restarts_total{{{decoy}}}", counter(1)),
        (f"vllm:external_prefix_cache_hits_total{{{decoy}}}", counter(100)),
        (f"vllm:external_prefix_cache_queries_total{{{decoy}}}", counter(100)),
        *((f"kvcompose_router_{name}_total{{{decoy}}}", counter(1 + index)) for index, name in enumerate(ROUTER_RATES)),
    ]


def hot_cold(hot: float, cold: float) -> list[tuple[dict[str, str], float]]:
    return [({"connector": "hot"}, hot), ({"connector": "cold"}, cold)]


def by_direction(hot_load: float, hot_save: float, cold_load: float) -> list[tuple[dict[str, str], float]]:
    return [({"connector": "hot", "direction": "load"}, hot_load),
            ({"connector": "hot", "direction": "save"}, hot_save),
            ({"connector": "cold", "direction": "load"}, cold_load)]


def by_op(hot_lookup: float, hot_start_load_kv: float, cold_lookup: float) -> list[tuple[dict[str, str], float]]:
    return [({"connector": "hot", "op": "lookup"}, hot_lookup),
            ({"connector": "hot", "op": "start_load_kv"}, hot_start_load_kv),
            ({"connector": "cold", "op": "lookup"}, cold_lookup)]


# Known answers per query of kvcompose.dashboard.queries, for every child $connector selects.
EXPECTED: dict[str, list[tuple[dict[str, str], float]]] = {
    "topology": [
        ({"pipeline": "p", "position": "0", "connector": "hot", "connector_class": "ExampleConnector"}, 1),
        ({"pipeline": "p", "position": "1", "connector": "cold", "connector_class": "ExampleConnector"}, 1),
    ],
    "lookup_hit_ratio": hot_cold(0.75, 0.25),
    "loaded_tokens": hot_cold(8, 0),
    "matched_tokens": hot_cold(16, 4),
    "latency_p50": by_op(0.5, 0.125, 0.125),
    "latency_p90": by_op(0.9, 0.225, 0.225),
    "latency_p99": by_op(0.99, 0.2475, 0.2475),
    "call_rate": by_op(1, 0.5, 1),
    "error_rate": [({"connector": "cold", "op": "lookup", "error_type": "OSError"}, 0.25),
                   ({"connector": "hot", "op": "start_load_kv", "error_type": "TimeoutError"}, 0.5)],
    "load_error_blocks": hot_cold(0, 2),
    "child_state": hot_cold(0, 2),
    "breaker_opens": hot_cold(0, 0.25),
    "vllm_external_hits": [({}, 8)],
    "vllm_external_hit_ratio": [({}, 0.25)],
    "calls_in_progress": [({"connector": "hot", "op": "lookup"}, 12), ({"connector": "cold", "op": "start_load_kv"}, 0)],
    "spans_dropped": [({"reason": "queue_full"}, 0.5), ({"reason": "export_failed"}, 0),
                      ({"reason": "exporter_down"}, 0.25), ({"reason": "shutdown"}, 0)],
    "spans_queued": [({"model_name": "m", "engine": "0"}, 40)],
    "exporter_restarts": [({"model_name": "m", "engine": "0"}, 0.25)],
    "copy_p50": by_direction(0.125, 0.125, 0.125),
    "copy_p99": by_direction(0.2475, 0.2475, 0.2475),
    "copy_throughput": by_direction(2048, 2048, 2048),
    "lifetime_p50": by_direction(0.5, 0.125, 0.125),
    "lifetime_p99": by_direction(0.99, 0.2475, 0.2475),
    "engine_wait": by_direction(0.5, 0.25, 0.125),
    "hit_ratio_by_size": [({"size_blocks": str(size)}, ratio)
                          for size, ratio in ((256, 0.25), (512, 0.5), (1024, 0.625), (2048, 0.75))],
    "capacity_marks": [({"connector": "gpu", "size_blocks": "256"}, 0.25),
                       ({"connector": "hot", "size_blocks": "1024"}, 0.625)],
    "tier_capacity_bytes": [({"connector": "gpu"}, 256 * 2**20), ({"connector": "hot"}, 768 * 2**20)],
    "prefill_saved": hot_cold(0.75, 0),
    "net_value": hot_cold(0.25, -0.125),
    "prefill_cost": [({"model_name": "m"}, 2**-11)],
    "write_waste": hot_cold(0.25, 0.5),
    "tokens_forgone": hot_cold(0, 4),
    "tenant_prompt_tokens": [({"tenant": "a"}, 100), ({"tenant": "other"}, 20)],
    "tenant_loaded_tokens": [({"tenant": "a", "connector": "hot"}, 6), ({"tenant": "other", "connector": "cold"}, 2)],
    "tenant_prefill_saved": [({"tenant": "a", "connector": "hot"}, 0.5),
                             ({"tenant": "other", "connector": "cold"}, 0.25)],
    "tenant_hit_ratio_at_gpu": [({"tenant": "a"}, 0.5), ({"tenant": "other"}, 0.125)],
    "transfer_bytes": by_direction(1024, 512, 2048),
    "transfers_in_flight": by_direction(3, 0, 1),
    "transfer_failures": [({"connector": "hot", "direction": "load", "outcome": "failed"}, 0.25),
                          ({"connector": "hot", "direction": "save", "outcome": "failed"}, 0),
                          ({"connector": "cold", "direction": "load", "outcome": "aborted"}, 0.5)],
    "router_predictions": [({"model_name": "m", "engine": "0"}, 0.5)],
    "router_overpredicted_share": [({"model_name": "m", "engine": "0"}, 0.375)],
    "router_underpredicted_share": [({"model_name": "m", "engine": "0"}, 0.125)],
    "router_invalid": [({"model_name": "m", "engine": "0"}, 0.25)],
    "router_predicted_tokens": [({"model_name": "m", "engine": "0"}, 64)],
    "router_reused_tokens": [({"model_name": "m", "engine": "0"}, 48)],
    "offload_load_bytes": [({"connector": "hot"}, 1024)],
    "offload_store_bytes": [({"connector": "hot"}, 512)],
    "offload_load_bandwidth": [({"connector": "hot"}, 2**20)],
    "offload_store_bandwidth": [({"connector": "hot"}, 2**19)],
    "offload_lookup_p99": [({"connector": "hot"}, 0.2475)],
    "offload_cpu_usage": [({"connector": "hot"}, 0.5)],
    "offload_allocation_failures": [({"connector": "hot"}, 0.25)],
    "nixl_transfer_p50": [({"connector": "cold"}, 0.5)],
    "nixl_transfer_p99": [({"connector": "cold"}, 0.99)],
    "nixl_bytes": [({"connector": "cold"}, 4096)],
    "nixl_failed_transfers": [({"connector": "cold"}, 0.25)],
    "nixl_expired_requests": [({"connector": "cold"}, 0.5)],
}
# label_values() of each template variable, narrowed by the variables before it.
EXPECTED_VARIABLE_VALUES = {
    "model_name": {"m", "other"},
    "engine": {"0", "1"},
    "connector": {"hot", "cold", "x"},
    "op": {"lookup", "start_load_kv", "wait_for_save"},
}
DASHBOARDS = dashboards()
CHILDREN = ["hot", "cold"]
# vLLM's engine counters the dashboard reads beside kvcompose's: its stat logger exports them, not a connector.
VLLM_ENGINE_SERIES = {"vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total"}


def test_every_catalogue_query_has_a_known_answer_and_appears_in_a_dashboard() -> None:
    assert set(EXPECTED) == {query.name for query in QUERIES}
    seen = {query_and_scope(t.expr, CHILDREN)[0].name for dashboard in DASHBOARDS.values() for t in targets(dashboard)}
    assert seen == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_dashboard_query_gives_the_known_answer(name: str, tmp_path: Path) -> None:
    dashboard = DASHBOARDS[name]
    cases = []
    for target in targets(dashboard):
        query, scope = query_and_scope(target.expr, CHILDREN)
        expected = [(labels, value) for labels, value in EXPECTED[query.name]
                    if scope.child in (None, labels.get("connector"))]
        assert expected, target.where
        cases.append(expr_test(fill(target.expr, VALUES, RATE_INTERVAL), expected))
    for variable, query in variable_queries(dashboard).items():
        series, label = label_values_parts(query)
        values = EXPECTED_VARIABLE_VALUES[variable]
        cases.append(expr_test(f"group by ({label}) ({fill(series, VALUES, RATE_INTERVAL)})",
                               [({label: value}, 1) for value in sorted(values)]))
    assert len(cases) == len(targets(dashboard)) + 4
    run_promtool(SERIES, cases, tmp_path)


def test_every_query_reads_what_the_real_metric_classes_export(vllm_config_with: Callable, tmp_path: Path) -> None:
    """kvcompose's Prometheus metrics for a pipeline of an OffloadingConnector ("hot") and a NIXL ("cold")
    child, built by vLLM's own classes (no GPU needed) and fed one of every stat, economics report and live
    value, then scraped as text: every dashboard query must find series in it. Catches renamed metrics and
    lost labels. vLLM's own engine counters (vllm:external_prefix_cache_*) are vLLM's stat logger's, not a
    connector's: tests/test_dashboard_live.py reads them from a real server."""
    series = []
    for family in _real_exposition(vllm_config_with):
        grows = family.type in ("counter", "histogram")
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ", ".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            values = f"0+{sample.value}x{SAMPLES}" if grows else gauge(sample.value)
            series.append((f"{sample.name}{{{labels}}}", values))
    everything = {"model_name": "m", "engine": "0", "connector": ".*", "op": ".*"}
    cases = [expr_test(f"group({fill(target.expr, everything, RATE_INTERVAL)})", [({}, 1)])
             for name in ("committed", "native-pipeline") for target in targets(DASHBOARDS[name])
             if not metrics_read(target.expr) & VLLM_ENGINE_SERIES]
    assert len(cases) > 40
    run_promtool(series, cases, tmp_path)


def _real_exposition(vllm_config_with: Callable) -> list[Any]:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
        get_connector_metric_definitions,
    )
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvcompose.config import load_pipeline
    from kvcompose.connectors import KVComposeConnector
    from kvcompose.connectors.children import child_specs
    from kvcompose.live import engine_ids
    from kvcompose.metrics.recorder import PipelineRecorder
    from kvcompose.metrics.transfers import TransferRecorder
    from kvcompose.operations import OPERATIONS
    from kvcompose.wire.economics import GPU, EconomicsReport
    from kvcompose.wire.native import NativeStats, class_path

    registry = CollectorRegistry()
    metric_types: dict[type, Any] = {kind: functools.partial(kind, registry=registry)
                                     for kind in (Counter, Gauge, Histogram)}
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": NATIVE_PIPELINE}})
    prom = KVComposeConnector.build_prom_metrics(config, metric_types, ["model_name", "engine"], {0: ["m", "0"]})
    specs = {spec.name: spec for spec in child_specs(config, load_pipeline(NATIVE_PIPELINE))}

    recorder = PipelineRecorder(True, load_pipeline(NATIVE_PIPELINE).metrics.latency_buckets, list(specs))
    for index, child in enumerate(specs):  # a call of every kind that feeds a kvcompose series
        for operation in ("get_num_new_matched_tokens", "update_state_after_alloc", "get_block_ids_with_load_errors",
                          "start_load_kv"):
            for _ in range(2):
                recorder.timed(recorder.slot(index, OPERATIONS[operation].label), 0.0001)
        for tokens in (16, 0):  # a hit and a miss
            recorder.request_admitted([(tokens, False)], [index], index if tokens else None, tokens)
        recorder.count_load_errors(child, 1, {1})
        recorder.count_error(child, OPERATIONS["start_load_kv"], OSError())  # what the child's guard tells it

    offload = OffloadingConnectorStats()  # one observation of every metric OffloadingConnector defines
    definitions = {**OffloadingSpecFactory.get_spec_cls({}).build_metric_definitions({}),
                   **get_connector_metric_definitions()}
    for metric, metadata in definitions.items():
        labels = tuple("x" for _ in metadata.labelnames)
        if isinstance(metadata, OffloadingCounterMetadata):
            offload.increase_counter(metric, 1024, labels)
        elif isinstance(metadata, OffloadingGaugeMetadata):
            offload.set_gauge(metric, 0.5, labels)
        else:
            offload.observe_histogram(metric, 0.001, labels)
    nixl = NixlKVConnectorStats()  # one entry in every list NIXL's stats keep
    for entries in nixl.data.values():
        entries.append(1)
    native = {"hot": NativeStats(class_path(specs["hot"].connector_cls), offload).to_dict(),
              "cold": NativeStats(class_path(specs["cold"].connector_cls), nixl).to_dict()}
    transfers = TransferRecorder(True, list(specs), load_pipeline(NATIVE_PIPELINE).metrics.transfer_buckets)
    for index in range(len(specs)):  # a transfer each way, the save failing, one still in flight
        for direction, outcome in (("load", "ok"), ("save", "failed")):
            transfers.started(index, direction)
            transfers.ended(index, direction, 0.002, 0.001, 4096, outcome, "0af7651916cd43dd8448eb211c80319c")
            transfers.waited(index, direction, 0.001)
        transfers.started(index, "load")
    breakers = {child: {"state": 2, "opens": 1} for child in specs}
    telemetry = {"dropped": {"queue_full": 3}, "spans_queued": 40, "exporter_restarts": 1}  # spans lost, a restart
    # The scheduler's curve (hot, 256 blocks below a GPU cache of 256, reaches to 512) and a worker's prefill cost,
    # cheap enough that both children's loads cost the engine more than they save.
    economics = EconomicsReport(curve=[[256, 0.5], [512, 0.75], [1024, 0.875]], capacities={"hot": 256, GPU: 256},
                                block_bytes=2**20, write_waste={"hot": 0.25}, prefill_seconds_per_token=1e-6)
    prom.observe({"economics": economics.to_dict(), "calls": recorder.take().to_dict(),
                  "transfers": transfers.take().to_dict(), "breakers": breakers, "native": native,
                  "telemetry": telemetry, "routing": {"predictions": 2, "predicted_tokens": 512, "reused_tokens": 128,
                                                      "overpredicted_tokens": 384, "underpredicted_tokens": 0,
                                                      "invalid": 1},
                  "tenants": {"prompt_tokens": {"acme": 512, "none": 64}, "loaded_tokens": {"acme": {"hot": 128, "cold": 16}},
                              "labelled": ["acme"], "curves": {"acme": [[256, 0.25], [512, 0.5]]}}}, 0)
    # hot's lookup is stuck (state 3); cold keeps its half-open breaker (2) and a call running long, not stuck yet
    _publish_stuck_calls(prom, engine_ids(config, [0])[0], [["hot", "lookup", 12.0, True],
                                                             ["cold", "start_load_kv", 0.5, False]])
    return list(text_string_to_metric_families(generate_latest(registry).decode()))


def _publish_stuck_calls(prom: Any, engine_id: str, running: list[list[Any]]) -> None:
    """What the engine's watchdog publishes on its live board while calls are stuck, read by the front-end."""
    from kvcompose.live import board
    from kvcompose.wire.telemetry import LIVE_RUNNING_CALLS

    live = board(engine_id)
    try:
        live.set(f"{LIVE_RUNNING_CALLS}.scheduler", running)
        live.publish()
        prom.live.read()
    finally:
        live.close()


def expr_test(expr: str, expected: list[tuple[dict[str, str], float]]) -> dict[str, Any]:
    return {"expr": expr, "eval_time": EVAL_TIME, "exp_samples": [
        {"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}", "value": value}
        for labels, value in expected]}


def run_promtool(series: list[tuple[str, str]], cases: list[dict[str, Any]], tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make test` installs it (scripts/ensure-prometheus.sh)"
    test_file = tmp_path / "dashboard_test.yaml"
    test_file.write_text(yaml.safe_dump({"evaluation_interval": f"{STEP_S}s", "tests": [{
        "interval": f"{STEP_S}s",
        "input_series": [{"series": name, "values": values} for name, values in series],
        "promql_expr_test": cases,
    }]}, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
