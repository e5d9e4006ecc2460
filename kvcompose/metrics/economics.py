"""The tier economics series the front-end makes of the engine's reports (kvcompose.wire.economics).

The front-end (:class:`EconomicsSeries`) sets the gauges, and prices what each
tier loaded: ``kvcompose_prefill_seconds_saved_total{connector}`` grows by the
tokens a tier was chosen to load times the engine's fitted prefill cost per
token, at the time they were loaded (tokens loaded before the first cost is
known are priced once it is).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter, Gauge

from kvcompose.wire.economics import EconomicsReport


class EconomicsSeries:
    """The front-end's economics series, per engine; see the module docstring."""

    def __init__(
        self, metric_types: dict[type, type], labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
        children: Sequence[str],
    ) -> None:
        """``labelnames``: vLLM's (model_name, engine)."""
        self._labels = per_engine_labelvalues
        self.hit_ratio = metric_types[Gauge](
            "kvcompose_cache_size_hit_ratio",
            "Estimated share of block references an LRU prefix cache of size_blocks blocks would serve, on the "
            "engine's recent traffic (SHARDS, decaying with a one-hour half-life).",
            labelnames=[*labelnames, "size_blocks"], multiprocess_mode="mostrecent")
        self.capacity = metric_types[Gauge](
            "kvcompose_tier_capacity_blocks", "Blocks each tier holds, where known; connector=\"gpu\": the blocks "
            "the GPU cache serves prefix hits from (0 with prefix caching off).",
            labelnames=[*labelnames, "connector"], multiprocess_mode="mostrecent")
        self.reach = metric_types[Gauge](
            "kvcompose_tier_reach_blocks",
            "The reuse distances each loading tier serves by the hit-ratio curve, from edge=\"start\" to "
            "edge=\"end\" (blocks): past the GPU cache and earlier loaders, within itself; start = end: none.",
            labelnames=[*labelnames, "connector", "edge"], multiprocess_mode="mostrecent")
        self.block_bytes = metric_types[Gauge](
            "kvcompose_kv_block_bytes", "Bytes of one KV cache block, over every layer and worker.",
            labelnames=labelnames, multiprocess_mode="mostrecent")
        self.write_waste = metric_types[Gauge](
            "kvcompose_write_waste_ratio",
            "Estimated share of the blocks saved to each tier that no later request reads from it at its size.",
            labelnames=[*labelnames, "connector"], multiprocess_mode="mostrecent")
        self.prefill_cost = metric_types[Gauge](
            "kvcompose_prefill_seconds_per_token",
            "The engine's marginal cost of prefilling one token, fitted online to its steps' forward time as a "
            "fixed cost per step plus a cost per prefill token and per decode token.",
            labelnames=labelnames, multiprocess_mode="mostrecent")
        self.saved = metric_types[Counter](
            "kvcompose_prefill_seconds_saved_total",
            "Prefill seconds each tier saved the engine: the tokens it was chosen to load, times the engine's "
            "fitted prefill cost per token (tokens loaded before that cost is known are priced once it is).",
            labelnames=[*labelnames, "connector"])
        for labels in per_engine_labelvalues.values():
            for child in children:
                self.saved.labels(*labels, child)
        self._cost: dict[int, float] = {}  # engine -> its latest prefill cost per token
        self._unpriced: dict[tuple[int, str], int] = {}  # (engine, child) -> tokens loaded before a cost was known
        self._sizes: dict[int, set[str]] = {}  # engine -> curve sizes shown

    def observe(self, report: EconomicsReport, engine_idx: int) -> None:
        labels = self._labels[engine_idx]
        if report.curve is not None:
            sizes = set()
            for size, ratio in report.curve:
                sizes.add(size_label := str(int(size)))
                self.hit_ratio.labels(*labels, size_label).set(ratio)
            for gone in self._sizes.get(engine_idx, set()) - sizes:  # the grid moved: a stale size would mislead
                self.hit_ratio.remove(*labels, gone)
            self._sizes[engine_idx] = sizes
        for child, blocks in (report.capacities or {}).items():
            self.capacity.labels(*labels, child).set(blocks)
        for child, (start, end) in (report.reaches or {}).items():
            self.reach.labels(*labels, child, "start").set(start)
            self.reach.labels(*labels, child, "end").set(end)
        if report.block_bytes is not None:
            self.block_bytes.labels(*labels).set(report.block_bytes)
        for child, share in (report.write_waste or {}).items():
            self.write_waste.labels(*labels, child).set(share)
        if report.prefill_seconds_per_token is not None:
            self._cost[engine_idx] = report.prefill_seconds_per_token
            self.prefill_cost.labels(*labels).set(report.prefill_seconds_per_token)
            for (engine, child), tokens in list(self._unpriced.items()):
                if engine == engine_idx:
                    self.loaded(engine, child, tokens)
                    del self._unpriced[(engine, child)]

    def cost(self, engine_idx: int) -> float | None:
        """The engine's latest prefill cost per token (None: not known yet)."""
        return self._cost.get(engine_idx)

    def loaded(self, engine_idx: int, child: str, tokens: int) -> None:
        """``child`` was chosen to load ``tokens`` tokens."""
        if (cost := self._cost.get(engine_idx)) is None:
            self._unpriced[(engine_idx, child)] = self._unpriced.get((engine_idx, child), 0) + tokens
            return
        self.saved.labels(*self._labels[engine_idx], child).inc(tokens * cost)
