"""Per-tier advice from observations: what each tier is worth now, and what another size would be worth.

- Value: prefill seconds saved per second (the tokens a tier loaded times the
  engine's fitted prefill cost per token) net of the engine wait its loads
  caused. Its saves' wait is shown beside it, not netted: a save pays off in
  a later load, possibly on another engine. Net negative, advise exits 1.
  Where the prefill cost is not known (no kvcompose_prefill_seconds_per_token,
  or 0: the fit has no estimate yet), nothing was priced and no tier is
  judged.
- Size: the curve says which share of prompt blocks an LRU cache of each size
  would serve. A loading tier serves the reuse distances in its reach, as the
  engine's sampler exported it (kvcompose_tier_reach_blocks, from
  ``sizes.tier_reaches``: past the GPU cache's prefix hits and earlier
  loaders, loaders only). Where the curve reaches 90% of its
  ceiling is the knee; a tier whose reach ends before it should grow to it,
  one whose reach ends past twice the knee could shrink to it. The marginal
  hit ratio per extra GiB is the curve's slope from the reach's end to the
  next size the curve was read at.
- Policy: tokens ``longest_match`` would have loaded beyond what the
  configured policy loaded, per child that had them.

Every recommendation carries the figures it rests on.

By tenant (``--by-tenant``): each tenant label's prompt tokens, the tokens
each tier loaded for it and the prefill seconds that saved, and its hit
ratio, by its own curve in the cache all tenants share, at the GPU cache's
size and at the end of each tier's reach (with the share the tier adds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcompose.economics.curve import Curve
from kvcompose.economics.observations import (
    DIRECTIONS,
    Observations,
    TenantAmounts,
    TierAmounts,
)
from kvcompose.economics.sizes import Reach, blocks_to_gib
from kvcompose.exposition import quantile

KNEE = 0.9  # the share of the curve's ceiling that marks where it flattens
SHRINK_PAST_KNEE = 2.0  # a reach ending this many times past the knee is worth shrinking
HIGH_WRITE_WASTE = 0.9
POLICY_SHARE = 0.05  # forgone tokens, as a share of the tokens the tier loaded, worth a policy change
COPY_QUANTILE = 0.99


@dataclass(frozen=True)
class Recommendation:
    # net_negative | value_unknown | grow | shrink | size_ok | past_the_knee | serves_nothing | write_waste
    # | load_policy
    kind: str
    text: str
    figures: dict[str, float | None]


@dataclass(frozen=True)
class CopyFigures:
    p99_s: float | None
    moved_bytes_per_s: float | None  # over the span
    copy_bytes_per_s: float | None  # while copying: bytes over the mover's copy time


@dataclass
class TierAdvice:
    name: str
    connector_class: str | None
    hit_ratio: float | None
    lookups: float
    tokens_per_s: float | None
    prefill_saved_s_per_s: float | None
    engine_wait_s_per_s: dict[str, float | None]
    net_s_per_s: float | None
    net_negative: bool
    copy: dict[str, CopyFigures]
    capacity_blocks: float | None
    capacity_gib: float | None
    reach: Reach | None  # None: not exported (it does not load, or it or an earlier loader has no known size)
    curve_share: float | None  # of prompt blocks, by the curve: hit(reach end) - hit(reach start)
    marginal_hit_ratio_per_gib: float | None
    write_waste: float | None
    tokens_forgone_per_s: float | None
    recommendations: list[Recommendation] = field(default_factory=list)


@dataclass(frozen=True)
class TenantTierFigures:
    tokens: float  # the tokens the tier loaded for the tenant
    tokens_per_s: float | None
    prefill_saved_s: float | None  # None: the prefill cost is not known, so nothing was priced
    prefill_saved_s_per_s: float | None
    hit_ratio_at_reach_end: float | None  # by the tenant's curve, with the caches above the tier
    curve_share: float | None  # of the tenant's prompt blocks the tier's reach serves, by its curve


@dataclass(frozen=True)
class TenantAdvice:
    name: str
    prompt_tokens: float
    prompt_tokens_per_s: float | None
    prompt_share: float | None  # of every tenant's prompt tokens
    hit_ratio_at_gpu: float | None  # by its curve, at the GPU cache's size (None: no curve, or no prefix hits)
    tiers: dict[str, TenantTierFigures]


@dataclass
class Advice:
    source: str
    span_s: float | None
    span_meaning: str
    gpu_blocks: float | None
    block_bytes: float | None
    prefill_s_per_token: float | None
    prompt_tokens_per_s: float | None
    curve: Curve | None
    knee_blocks: int | None  # where the curve reaches KNEE of its ceiling
    tiers: list[TierAdvice]
    tenants: list[TenantAdvice] = field(default_factory=list)  # by prompt tokens, most first

    @property
    def net_negative(self) -> list[str]:
        return [tier.name for tier in self.tiers if tier.net_negative]

    @property
    def cost_known(self) -> bool:
        """Whether loads were priced: the engine's prefill cost per token is known (a fit above zero)."""
        return self.prefill_s_per_token is not None and self.prefill_s_per_token > 0


def advise(observations: Observations) -> Advice:
    curve = Curve.from_points(observations.curve_points)
    knee = round(curve.size_reaching(KNEE)) if curve is not None and curve.ceiling > 0 else None
    advice = Advice(observations.source, observations.span_s, observations.span_meaning, observations.gpu_blocks,
                    observations.block_bytes, observations.prefill_s_per_token,
                    _per_second(observations.prompt_tokens, observations.span_s), curve, knee, [])
    tiers = observations.ordered_tiers()
    advice.tiers = [_tier(advice, tier, _reach(tier)) for tier in tiers]
    total = sum(tenant.prompt_tokens for tenant in observations.tenants.values())
    advice.tenants = sorted((_tenant(advice, tenant, tiers, total) for tenant in observations.tenants.values()),
                            key=lambda tenant: (-tenant.prompt_tokens, tenant.name))
    return advice


def _tenant(advice: Advice, tenant: TenantAmounts, tiers: list[TierAmounts], total: float) -> TenantAdvice:
    span = advice.span_s
    curve = Curve.from_points(tenant.curve_points)
    figures = {}
    for tier in tiers:
        reach = _reach(tier)
        saved = tenant.prefill_saved_s.get(tier.name, 0.0) if advice.cost_known else None
        at_end = curve.at(reach.end) if curve is not None and reach is not None else None
        figures[tier.name] = TenantTierFigures(
            tokens=tenant.loaded_tokens.get(tier.name, 0.0),
            tokens_per_s=_per_second(tenant.loaded_tokens.get(tier.name, 0.0), span),
            prefill_saved_s=saved, prefill_saved_s_per_s=_per_second(saved, span), hit_ratio_at_reach_end=at_end,
            curve_share=at_end - curve.at(reach.start) if at_end is not None and curve and reach else None)
    gpu = advice.gpu_blocks
    return TenantAdvice(tenant.name, tenant.prompt_tokens, _per_second(tenant.prompt_tokens, span),
                        tenant.prompt_tokens / total if total else None,
                        curve.at(gpu) if curve is not None and gpu else None, figures)


def _reach(tier: TierAmounts) -> Reach | None:
    edges = tier.reach_edges
    return Reach(round(edges["start"]), round(edges["end"])) if {"start", "end"} <= edges.keys() else None


def _per_second(amount: float | None, span_s: float | None) -> float | None:
    return amount / span_s if amount is not None and span_s else None


def _gib(advice: Advice, blocks: float | None) -> float | None:
    return blocks_to_gib(blocks, int(advice.block_bytes)) if blocks is not None and advice.block_bytes else None


def _tier(advice: Advice, tier: TierAmounts, reach: Reach | None) -> TierAdvice:
    span = advice.span_s
    waits = {direction: tier.directions[direction].engine_wait_s for direction in DIRECTIONS}
    # Net value: the prefill a tier's loads saved less the engine wait they caused. Its saves' wait is shown
    # beside it (and in the write-waste advice), not netted: a tier that saves for another engine's loads
    # pays for them here. A tier that loaded nothing is not judged (as the alert does not): every loader's
    # start_load_kv runs each step, so it has a little load wait even when it has nothing to load. Without a
    # prefill cost nothing was priced: the saved seconds read 0 whatever the loads spared, and no tier is judged.
    load_wait = waits["load"]
    saved = tier.prefill_saved_s if advice.cost_known else None
    figures = TierAdvice(
        name=tier.name, connector_class=tier.connector_class,
        hit_ratio=tier.hits / tier.lookups if tier.lookups else None, lookups=tier.lookups,
        tokens_per_s=_per_second(tier.loaded_tokens, span),
        prefill_saved_s_per_s=_per_second(saved, span),
        engine_wait_s_per_s={direction: _per_second(wait, span) for direction, wait in waits.items()},
        net_s_per_s=_per_second(saved - load_wait, span) if saved is not None else None,
        net_negative=saved is not None and tier.loaded_tokens > 0 and saved < load_wait,
        copy={direction: _copy(tier, direction, span) for direction in DIRECTIONS},
        capacity_blocks=tier.capacity_blocks, capacity_gib=_gib(advice, tier.capacity_blocks), reach=reach,
        curve_share=(advice.curve.at(reach.end) - advice.curve.at(reach.start)
                     if advice.curve is not None and reach is not None else None),
        marginal_hit_ratio_per_gib=None, write_waste=tier.write_waste,
        tokens_forgone_per_s=_per_second(tier.forgone_tokens, span))
    if figures.net_negative:
        figures.recommendations.append(_net_negative(figures, saved or 0.0, waits))
    elif not advice.cost_known and tier.loaded_tokens > 0:
        figures.recommendations.append(_value_unknown(advice, tier, waits))
    curve, knee = advice.curve, advice.knee_blocks
    if curve is not None and knee is not None and reach is not None:
        figures.recommendations.append(_sizing(advice, figures, reach, curve, knee))
    if tier.write_waste is not None and tier.write_waste >= HIGH_WRITE_WASTE:
        figures.recommendations.append(Recommendation(
            "write_waste", f"{tier.write_waste:.0%} of the blocks written to it are not read from it before "
            f"they leave it (at or above {HIGH_WRITE_WASTE:.0%}): its saves buy little at this size; the saves "
            f"held the engine {_seconds_per_second(figures.engine_wait_s_per_s['save'])}",
            {"write_waste": tier.write_waste, "save_wait_s_per_s": figures.engine_wait_s_per_s["save"]}))
    if tier.forgone_tokens > 0 and tier.forgone_tokens >= POLICY_SHARE * tier.loaded_tokens:
        figures.recommendations.append(_load_policy(advice, figures, tier))
    return figures


def _copy(tier: TierAmounts, direction: str, span: float | None) -> CopyFigures:
    amounts = tier.directions[direction]
    return CopyFigures(quantile(COPY_QUANTILE, amounts.copy_buckets.items()), _per_second(amounts.bytes, span),
                       amounts.copied_bytes / amounts.copy_s if amounts.copy_s > 0 else None)


def _net_negative(tier: TierAdvice, saved: float, waits: dict[str, float]) -> Recommendation:
    return Recommendation(
        "net_negative",
        f"net negative: it saved {saved:.3g} s of prefill but its loads held the engine {waits['load']:.3g} s (its "
        f"saves a further {waits['save']:.3g} s); turn it off, or make its transfers asynchronous, before rolling "
        "it out",
        {"prefill_saved_s": saved, "engine_wait_load_s": waits["load"], "engine_wait_save_s": waits["save"],
         "net_s_per_s": tier.net_s_per_s})


def _value_unknown(advice: Advice, amounts: TierAmounts, waits: dict[str, float]) -> Recommendation:
    cost = "0" if advice.prefill_s_per_token == 0 else "absent"
    return Recommendation(
        "value_unknown",
        f"cannot judge whether it pays: the engine's prefill cost per token is not known "
        f"(kvcompose_prefill_seconds_per_token {cost}: the fit needs steps of varied prefill sizes), so the "
        f"{amounts.loaded_tokens:,.0f} tokens it loaded are not priced against the {waits['load']:.3g} s its "
        "loads held the engine",
        {"tokens_loaded": amounts.loaded_tokens, "engine_wait_load_s": waits["load"],
         "prefill_s_per_token": advice.prefill_s_per_token})


def _sizing(advice: Advice, tier: TierAdvice, reach: Reach, curve: Curve, knee: int) -> Recommendation:
    if reach.empty:
        return Recommendation(
            "serves_nothing", "by the curve it serves no reuse distance: an earlier loader is at least as large "
            "(every tier holds the last blocks written, and the first to have a block loads it)",
            {"capacity_blocks": tier.capacity_blocks})
    start, end = reach.start, reach.end
    upper = curve.next_size_above(end)
    if upper is not None and advice.block_bytes:
        tier.marginal_hit_ratio_per_gib = (curve.at(upper) - curve.at(end)) / blocks_to_gib(
            upper - end, int(advice.block_bytes))
    figures: dict[str, float | None] = {
        "reach_start_blocks": start, "reach_end_blocks": end, "knee_blocks": knee, "ceiling": curve.ceiling,
        "hit_ratio_at_reach_end": curve.at(end), "marginal_hit_ratio_per_gib": tier.marginal_hit_ratio_per_gib}
    where = (f"with the caches above it, it reaches {end:,} blocks (hit ratio {curve.at(end):.3f}); the curve "
             f"reaches {KNEE:.0%} of its ceiling {curve.ceiling:.3f} at {knee:,.0f} blocks{gib_text(advice, knee)}")
    if knee <= start:
        return Recommendation(
            "past_the_knee", f"the caches above it already reach the knee: {where}; it adds "
            f"{curve.at(end) - curve.at(start):.3f} of prompt blocks{_marginal_text(tier)}", figures)
    target = knee - start
    figures["recommended_capacity_blocks"] = target
    figures["recommended_capacity_gib"] = _gib(advice, target)
    change = f"{target:,} blocks ({_gib_change(advice, target, target - (tier.capacity_blocks or 0))})"
    if end < knee:
        gain = curve.at(knee) - curve.at(end)
        figures["hit_ratio_gain"] = gain
        figures["prefill_s_per_s_gain"] = _prefill_value(advice, gain)
        return Recommendation("grow", f"grow it to {change}: {where}; the hit ratio would rise by {gain:.3f}"
                              f"{_value_text(advice, gain)}{_marginal_text(tier)}", figures)
    if end >= SHRINK_PAST_KNEE * knee:
        loss = curve.at(end) - curve.at(knee)
        figures["hit_ratio_loss"] = loss
        figures["prefill_s_per_s_loss"] = _prefill_value(advice, loss)
        return Recommendation("shrink", f"it could shrink to {change}: {where}, and it ends past "
                              f"{SHRINK_PAST_KNEE:g}x that; the hit ratio would fall by {loss:.3f}"
                              f"{_value_text(advice, loss)}{_marginal_text(tier)}", figures)
    return Recommendation("size_ok", f"its size is right for the traffic: {where}, and it ends within "
                          f"{SHRINK_PAST_KNEE:g}x that{_marginal_text(tier)}", figures)


def _load_policy(advice: Advice, tier: TierAdvice, amounts: TierAmounts) -> Recommendation:
    value = amounts.forgone_tokens * advice.prefill_s_per_token if advice.cost_known else None
    per_second = f" ({tier.tokens_forgone_per_s:.3g} tokens/s)" if tier.tokens_forgone_per_s is not None else ""
    worth = f", worth {value:.3g} s of prefill" if value is not None else ""
    return Recommendation(
        "load_policy", f"load.policy longest_match would have loaded {amounts.forgone_tokens:,.0f} more tokens from "
        f"it{per_second}{worth}, {_share(amounts.forgone_tokens, amounts.loaded_tokens)} of what it loaded; "
        f"consider it if asking every child per request costs less", {
            "tokens_forgone": amounts.forgone_tokens, "tokens_loaded": amounts.loaded_tokens,
            "prefill_s_forgone": value})


def _prefill_value(advice: Advice, hit_ratio: float) -> float | None:
    """Prefill seconds per second that ``hit_ratio`` more of the prompt blocks would save."""
    if advice.prompt_tokens_per_s is None or not advice.cost_known:
        return None
    return hit_ratio * advice.prompt_tokens_per_s * advice.prefill_s_per_token


def _value_text(advice: Advice, hit_ratio: float) -> str:
    value = _prefill_value(advice, hit_ratio)
    return f", {value:.3g} s of prefill per second at today's {advice.prompt_tokens_per_s:,.0f} prompt tokens/s" \
        if value is not None else ""


def _marginal_text(tier: TierAdvice) -> str:
    marginal = tier.marginal_hit_ratio_per_gib
    return f"; at its size each extra GiB adds {marginal:.4f} to the hit ratio" if marginal is not None else ""


def gib_text(advice: Advice, blocks: float | None) -> str:
    """`` (N GiB)`` for ``blocks``, or nothing when the block size (or the count) is unknown."""
    gib = _gib(advice, blocks)
    return f" ({gib:,.1f} GiB)" if gib is not None else ""


def _gib_change(advice: Advice, blocks: float, change: float) -> str:
    gib, gib_change = _gib(advice, blocks), _gib(advice, change)
    return f"{gib:,.1f} GiB, {gib_change:+,.1f} GiB" if gib is not None else f"{change:+,.0f} blocks"


def _seconds_per_second(value: float | None) -> str:
    return f"{value:.3g} s/s" if value is not None else "an unknown time (no span)"


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole else "all"
