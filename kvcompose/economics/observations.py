"""What ``kvcompose advise`` reads, whatever the source: per-tier amounts over a span of time, and the curve.

Counters are amounts over the span (Prometheus' ``increase`` over the window,
or a saved /metrics' totals since the server started), summed over engines;
gauges (the curve, capacities, reaches, block size, prefill cost, write
waste) are averaged over engines and, from Prometheus, over the window.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from kvcompose.operations import DIRECTIONS
from kvcompose.wire.economics import GPU

# vLLM's prompt token counter; prometheus_client writes its colon as an underscore in OpenMetrics.
PROMPT_TOKENS = ("vllm:prompt_tokens_total", "vllm_prompt_tokens_total")


class InputError(Exception):
    """The input cannot be advised on; the message is one line."""


@dataclass
class DirectionAmounts:
    engine_wait_s: float = 0.0
    bytes: float = 0.0  # of every ended transfer
    copied_bytes: float = 0.0  # of the transfers with a copy time: those copy_s covers
    copy_s: float = 0.0
    copies: float = 0.0
    copy_buckets: dict[float, float] = field(default_factory=lambda: defaultdict(float))  # le -> cumulative


@dataclass
class TierAmounts:
    name: str
    position: float = float("inf")  # in the pipeline; unknown ones last
    connector_class: str | None = None
    hits: float = 0.0
    lookups: float = 0.0
    loaded_tokens: float = 0.0
    prefill_saved_s: float | None = None  # None: the series is absent (an earlier kvcompose)
    forgone_tokens: float = 0.0
    capacity_blocks: float | None = None
    reach_edges: dict[str, float] = field(default_factory=dict)  # start, end: the reuse distances it serves
    write_waste: float | None = None
    directions: dict[str, DirectionAmounts] = field(default_factory=lambda: {d: DirectionAmounts() for d in DIRECTIONS})


@dataclass
class TenantAmounts:
    """One tenant label's amounts (kvcompose_tenant_* series) and its hit-ratio curve."""

    name: str
    prompt_tokens: float = 0.0
    loaded_tokens: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # tier -> tokens
    prefill_saved_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # tier -> seconds
    curve_points: dict[int, float] = field(default_factory=dict)


@dataclass
class Observations:
    source: str
    span_s: float | None  # what the amounts cover; None when unknown (then no per-second figures)
    span_meaning: str
    tiers: dict[str, TierAmounts] = field(default_factory=dict)
    curve_points: dict[int, float] = field(default_factory=dict)
    gpu_blocks: float | None = None
    block_bytes: float | None = None
    prefill_s_per_token: float | None = None
    prompt_tokens: float | None = None
    tenants: dict[str, TenantAmounts] = field(default_factory=dict)

    def tier(self, name: str) -> TierAmounts:
        if name not in self.tiers:
            self.tiers[name] = TierAmounts(name)
        return self.tiers[name]

    def ordered_tiers(self) -> list[TierAmounts]:
        return sorted(self.tiers.values(), key=lambda tier: (tier.position, tier.name))


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class ObservationsBuilder:
    """Collects samples ``(name, labels, value)`` of kvcompose's series, from either source, into Observations.

    Counter samples add up; gauge samples are averaged at ``build``."""

    def __init__(self, source: str, span_s: float | None, span_meaning: str):
        self._observations = Observations(source, span_s, span_meaning)
        self._capacities: dict[str, list[float]] = defaultdict(list)
        self._reach_edges: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._waste: dict[str, list[float]] = defaultdict(list)
        self._curve: dict[int, list[float]] = defaultdict(list)
        self._block_bytes: list[float] = []
        self._prefill_cost: list[float] = []
        self._tenant_curves: dict[tuple[str, int], list[float]] = defaultdict(list)

    def add(self, name: str, labels: dict[str, str], value: float) -> None:
        if math.isnan(value):  # a gauge with nothing to show yet (a curve before traffic, waste before writes)
            return
        observations = self._observations
        connector = labels.get("connector")
        if (tenant := labels.get("tenant")) is not None:
            self._add_to_tenant(tenant, name, connector, labels, value)
        elif name == "kvcompose_cache_size_hit_ratio":
            self._curve[int(float(labels["size_blocks"]))].append(value)
        elif name == "kvcompose_kv_block_bytes":
            self._block_bytes.append(value)
        elif name == "kvcompose_prefill_seconds_per_token":
            self._prefill_cost.append(value)
        elif name in PROMPT_TOKENS:
            observations.prompt_tokens = (observations.prompt_tokens or 0.0) + value
        elif name == "kvcompose_tier_capacity_blocks" and connector is not None:
            self._capacities[connector].append(value)
        elif name == "kvcompose_tier_reach_blocks" and connector is not None and "edge" in labels:
            self._reach_edges[(connector, labels["edge"])].append(value)
        elif connector is not None:
            self._add_to_tier(observations.tier(connector), name, labels, value)

    def _add_to_tier(self, tier: TierAmounts, name: str, labels: dict[str, str], value: float) -> None:
        if name == "kvcompose_pipeline_info":
            position = labels.get("position", "")
            tier.position = min(tier.position, float(position)) if position.isdigit() else tier.position
            tier.connector_class = labels.get("connector_class", tier.connector_class)
        elif name == "kvcompose_lookups_total":
            tier.lookups += value
            tier.hits += value if labels.get("result") == "hit" else 0.0
        elif name == "kvcompose_loaded_tokens_total":
            tier.loaded_tokens += value
        elif name == "kvcompose_prefill_seconds_saved_total":
            tier.prefill_saved_s = (tier.prefill_saved_s or 0.0) + value
        elif name == "kvcompose_tokens_forgone_total":
            tier.forgone_tokens += value
        elif name == "kvcompose_write_waste_ratio":
            self._waste[tier.name].append(value)
        elif labels.get("direction") in DIRECTIONS:
            self._add_to_direction(tier.directions[labels["direction"]], name, labels, value)

    def _add_to_tenant(self, name: str, series: str, connector: str | None, labels: dict[str, str],
                       value: float) -> None:
        tenants = self._observations.tenants
        if name not in tenants:
            tenants[name] = TenantAmounts(name)
        tenant = tenants[name]
        if series == "kvcompose_tenant_prompt_tokens_total":
            tenant.prompt_tokens += value
        elif series == "kvcompose_tenant_loaded_tokens_total" and connector is not None:
            tenant.loaded_tokens[connector] += value
        elif series == "kvcompose_tenant_prefill_seconds_saved_total" and connector is not None:
            tenant.prefill_saved_s[connector] += value
        elif series == "kvcompose_tenant_cache_size_hit_ratio":
            self._tenant_curves[(name, int(float(labels["size_blocks"])))].append(value)

    @staticmethod
    def _add_to_direction(amounts: DirectionAmounts, name: str, labels: dict[str, str], value: float) -> None:
        if name == "kvcompose_engine_wait_seconds_total":
            amounts.engine_wait_s += value
        elif name == "kvcompose_transfer_bytes_total":
            amounts.bytes += value
        elif name == "kvcompose_transfer_copied_bytes_total":
            amounts.copied_bytes += value
        elif name == "kvcompose_transfer_copy_seconds_sum":
            amounts.copy_s += value
        elif name == "kvcompose_transfer_copy_seconds_count":
            amounts.copies += value
        elif name == "kvcompose_transfer_copy_seconds_bucket":
            amounts.copy_buckets[float(labels["le"])] += value

    def build(self) -> Observations:
        observations = self._observations
        gpu = self._capacities.pop(GPU, [])
        observations.gpu_blocks = mean(gpu)
        for name, values in self._capacities.items():
            observations.tier(name).capacity_blocks = mean(values)
        for (name, edge), values in self._reach_edges.items():
            observations.tier(name).reach_edges[edge] = sum(values) / len(values)
        for name, values in self._waste.items():
            observations.tier(name).write_waste = mean(values)
        observations.curve_points = {size: sum(values) / len(values) for size, values in self._curve.items()}
        for (tenant, size), values in self._tenant_curves.items():
            observations.tenants[tenant].curve_points[size] = sum(values) / len(values)
        observations.block_bytes = mean(self._block_bytes)
        observations.prefill_s_per_token = mean(self._prefill_cost)
        return observations
