"""The per-tenant series the front-end makes of the scheduler's tenant reports (kvcompose.wire.tenants).

Each counter splits a pipeline-wide one by tenant label: prompt tokens
(vLLM's ``vllm:prompt_tokens_total``), tokens each child was chosen to load
(``kvcompose_loaded_tokens_total``) and the prefill seconds that saved
(``kvcompose_prefill_seconds_saved_total``, priced at the same cost at the
same time: tokens loaded before the engine's cost is known are priced once
it is). Summed over the tenant labels, each equals the series it splits.

A tenant the scheduler no longer labels (it fell out of the top K) is folded
into ``other``: its series are removed and their totals added to ``other``'s.
The sums hold, every series stays monotonic, and an engine shows at most
top K + 3 tenant labels (``other``, ``none``, ``invalid``); ``other`` steps up
by the folded totals when it happens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from kvcompose.wire.tenants import OTHER, RESERVED, TenantReport

TENANT_LABEL = "tenant"


@dataclass
class _EngineTenants:
    """One engine's labels and the totals of its tenant series (to fold a label into ``other``)."""

    labelled: set[str] = field(default_factory=set)
    prompt: dict[str, int] = field(default_factory=dict)  # tenant -> prompt tokens
    loaded: dict[tuple[str, str], int] = field(default_factory=dict)  # (tenant, child) -> tokens
    saved: dict[tuple[str, str], float] = field(default_factory=dict)  # (tenant, child) -> seconds
    unpriced: dict[tuple[str, str], int] = field(default_factory=dict)  # (tenant, child) -> tokens not priced yet
    curve_sizes: dict[str, set[str]] = field(default_factory=dict)  # tenant -> size labels shown


class TenantSeries:
    """The front-end's per-tenant series, per engine; see the module docstring."""

    def __init__(self, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], children: Sequence[str]) -> None:
        self._labels = per_engine_labelvalues
        self.prompt = metric_types[Counter](
            "kvcompose_tenant_prompt_tokens_total",
            "Prompt tokens of the requests the engine admitted, by tenant (the top tenants by prompt tokens; "
            "others: 'other'; no tenant: 'none').", labelnames=[*labelnames, TENANT_LABEL])
        self.loaded = metric_types[Counter](
            "kvcompose_tenant_loaded_tokens_total", "Tokens each child was chosen to load, by tenant.",
            labelnames=[*labelnames, TENANT_LABEL, "connector"])
        self.saved = metric_types[Counter](
            "kvcompose_tenant_prefill_seconds_saved_total",
            "Prefill seconds each tier saved the engine, by tenant: its loaded tokens times the engine's fitted "
            "prefill cost per token.", labelnames=[*labelnames, TENANT_LABEL, "connector"])
        self.hit_ratio = metric_types[Gauge](
            "kvcompose_tenant_cache_size_hit_ratio",
            "Estimated share of a tenant's prompt block references an LRU prefix cache of size_blocks blocks, "
            "shared by every tenant, would serve (one SHARDS sampler, references attributed to tenants).",
            labelnames=[*labelnames, TENANT_LABEL, "size_blocks"], multiprocess_mode="mostrecent")
        self._engines = {engine: _EngineTenants() for engine in per_engine_labelvalues}
        for labels in per_engine_labelvalues.values():  # each starts at 0, so its first increase shows
            for tenant in RESERVED:
                self.prompt.labels(*labels, tenant)
                for child in children:
                    self.loaded.labels(*labels, tenant, child)
                    self.saved.labels(*labels, tenant, child)

    def observe(self, report: TenantReport, engine_idx: int, cost: float | None) -> None:
        """Add a report of engine ``engine_idx``; ``cost``: its prefill seconds per token, where known."""
        state, labels = self._engines[engine_idx], self._labels[engine_idx]
        if report.labelled is not None:
            labelled = set(report.labelled)
            for gone in (set(state.prompt) | {tenant for tenant, _ in state.loaded}) - labelled - set(RESERVED):
                self._fold(state, labels, gone)
            state.labelled = labelled
        shown = state.labelled
        for tenant, tokens in report.prompt_tokens.items():
            label = tenant if tenant in shown or tenant in RESERVED else OTHER
            state.prompt[label] = state.prompt.get(label, 0) + tokens
            self.prompt.labels(*labels, label).inc(tokens)
        if cost is not None and state.unpriced:
            unpriced, state.unpriced = state.unpriced, {}
            for (tenant, child), tokens in unpriced.items():
                self._price(state, labels, tenant, child, tokens * cost)
        for tenant, by_child in report.loaded_tokens.items():
            label = tenant if tenant in shown or tenant in RESERVED else OTHER
            for child, tokens in by_child.items():
                key = (label, child)
                state.loaded[key] = state.loaded.get(key, 0) + tokens
                self.loaded.labels(*labels, label, child).inc(tokens)
                if cost is None:
                    state.unpriced[key] = state.unpriced.get(key, 0) + tokens
                else:
                    self._price(state, labels, label, child, tokens * cost)
        if report.curves is not None:
            self._show_curves(state, labels, report.curves)

    def _price(self, state: _EngineTenants, labels: list[object], tenant: str, child: str, seconds: float) -> None:
        state.saved[(tenant, child)] = state.saved.get((tenant, child), 0.0) + seconds
        self.saved.labels(*labels, tenant, child).inc(seconds)

    def _fold(self, state: _EngineTenants, labels: list[object], tenant: str) -> None:
        """``tenant`` lost its label: its totals go to ``other``, its series away."""
        if (tokens := state.prompt.pop(tenant, None)) is not None:
            self.prompt.remove(*labels, tenant)
            state.prompt[OTHER] = state.prompt.get(OTHER, 0) + tokens
            self.prompt.labels(*labels, OTHER).inc(tokens)
        for tenant_child in [key for key in state.loaded if key[0] == tenant]:
            child = tenant_child[1]
            tokens = state.loaded.pop(tenant_child)
            seconds = state.saved.pop(tenant_child, 0.0)
            self.loaded.remove(*labels, tenant, child)
            state.loaded[(OTHER, child)] = state.loaded.get((OTHER, child), 0) + tokens
            self.loaded.labels(*labels, OTHER, child).inc(tokens)
            if tenant_child in state.unpriced:
                state.unpriced[(OTHER, child)] = state.unpriced.get((OTHER, child), 0) + state.unpriced.pop(
                    tenant_child)
            self.saved.remove(*labels, tenant, child)
            self._price(state, labels, OTHER, child, seconds)
        for size in state.curve_sizes.pop(tenant, ()):
            self.hit_ratio.remove(*labels, tenant, size)

    def _show_curves(self, state: _EngineTenants, labels: list[object],
                     curves: dict[str, list[list[float]]]) -> None:
        for tenant in list(state.curve_sizes):
            if tenant not in curves:
                for size in state.curve_sizes.pop(tenant):
                    self.hit_ratio.remove(*labels, tenant, size)
        for tenant, curve in curves.items():
            if tenant not in state.labelled and tenant not in RESERVED:
                continue
            sizes = set()
            for size, ratio in curve:
                sizes.add(size_label := str(int(size)))
                self.hit_ratio.labels(*labels, tenant, size_label).set(ratio)
            for gone in state.curve_sizes.get(tenant, set()) - sizes:
                self.hit_ratio.remove(*labels, tenant, gone)
            state.curve_sizes[tenant] = sizes
