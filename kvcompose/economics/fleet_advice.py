"""``kvcompose advise --fleet``: each shared tier by the fleet's curve, and its value summed over the engines.

A shared tier's size is read on the curve ``kvcompose fleet`` merged from
every engine naming it (``kvcompose_fleet_cache_size_hit_ratio{tier}``), not
on any one engine's: its hit ratio at its capacity, where the curve reaches
90% of its ceiling, and whether it should grow or could shrink. Its value is
what the engines' own series say, summed over them: the prefill seconds its
child saved (``kvcompose_prefill_seconds_saved_total{connector}``) net of the
engine wait its loads caused, for the children the engines name it by
(``kvcompose_fleet_tier_child_info``). Where the engines' keys cannot agree
the tier has no curve, and advise says so.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field

from kvcompose.economics.advice import KNEE, SHRINK_PAST_KNEE
from kvcompose.economics.curve import Curve
from kvcompose.economics.observations import InputError, Observations
from kvcompose.exposition import ExpositionError, read

FLEET_PREFIX = ("kvcompose_fleet_",)
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SharedTier:
    """What the aggregator's /metrics says of one shared tier."""

    tier: str
    children: tuple[str, ...]
    engines: int
    capacity_blocks: float | None
    curve: Curve | None
    keys_agree: bool
    references: float
    sampled_references: float


@dataclass
class SharedTierAdvice:
    tier: str
    children: tuple[str, ...]
    engines: int
    keys_agree: bool
    references: float
    sampled_references: float
    capacity_blocks: float | None
    ceiling: float | None
    knee_blocks: float | None
    hit_ratio_at_capacity: float | None
    prefill_saved_s: float | None  # summed over the engines; None where no cost per token is known
    load_wait_s: float
    net_s: float | None
    net_s_per_s: float | None
    net_negative: bool
    recommendations: list[str] = field(default_factory=list)


def read_fleet_source(source: str) -> str:
    """The text of the aggregator's /metrics: a saved file, or its http(s) URL."""
    try:
        if source.startswith(("http://", "https://")):
            with urllib.request.urlopen(source, timeout=TIMEOUT_S) as response:
                return response.read().decode()
        with open(source) as saved:
            return saved.read()
    except (OSError, UnicodeDecodeError, urllib.error.URLError) as error:
        raise InputError(f"--fleet {source}: cannot read: {getattr(error, 'strerror', None) or error}") from None


def read_fleet(text: str, source: str) -> list[SharedTier]:
    """The shared tiers in the aggregator's exposition ``text``."""
    try:
        exposition = read(text, FLEET_PREFIX)
    except ExpositionError as error:
        raise InputError(f"--fleet {source}: {error}") from None
    engines = {sample.labels.get("tier", ""): sample.value for sample in exposition.series("kvcompose_fleet_engines")}
    if not engines:
        raise InputError(f"--fleet {source}: no kvcompose_fleet_engines: not the /metrics of kvcompose fleet")
    tiers = []
    for tier in sorted(engines):
        points = {int(float(sample.labels["size_blocks"])): sample.value
                  for sample in exposition.series("kvcompose_fleet_cache_size_hit_ratio", tier=tier)
                  if sample.labels.get("size_blocks", "").isdigit()}
        capacity = exposition.series("kvcompose_fleet_tier_capacity_blocks", tier=tier)
        tiers.append(SharedTier(
            tier, tuple(sorted(sample.labels["connector"] for sample in
                               exposition.series("kvcompose_fleet_tier_child_info", tier=tier))),
            int(engines[tier]), capacity[0].value if capacity else None, Curve.from_points(points),
            exposition.total("kvcompose_fleet_keys_agree", tier=tier) > 0,
            exposition.total("kvcompose_fleet_references_total", tier=tier),
            exposition.total("kvcompose_fleet_sampled_references_total", tier=tier)))
    return tiers


def advise_shared(tiers: list[SharedTier], observations: Observations, cost_known: bool) -> list[SharedTierAdvice]:
    return [_advise_one(tier, observations, cost_known) for tier in tiers]


def _advise_one(shared: SharedTier, observations: Observations, cost_known: bool) -> SharedTierAdvice:
    children = [observations.tiers[name] for name in shared.children if name in observations.tiers]
    saved = sum(child.prefill_saved_s or 0.0 for child in children) if cost_known and children else None
    wait = sum(child.directions["load"].engine_wait_s for child in children)
    loaded = sum(child.loaded_tokens for child in children)
    curve = shared.curve
    ceiling = curve.ceiling if curve is not None else None
    knee = curve.size_reaching(KNEE) if curve is not None and curve.ceiling > 0 else None
    capacity = shared.capacity_blocks
    span = observations.span_s
    advice = SharedTierAdvice(
        shared.tier, shared.children, shared.engines, shared.keys_agree, shared.references,
        shared.sampled_references, capacity, ceiling, knee,
        curve.at(capacity) if curve is not None and capacity is not None else None, saved, wait,
        saved - wait if saved is not None else None,
        (saved - wait) / span if saved is not None and span else None,
        saved is not None and loaded > 0 and saved < wait)
    notes = advice.recommendations
    if not shared.keys_agree:
        notes.append("no fleet curve: the engines naming it cannot agree on their block keys or sample rate "
                     "(kvcompose fleet's log names them); size it after fixing that")
    elif curve is None:
        notes.append("no fleet curve yet: kvcompose fleet has merged no reference to it")
    if not children:
        notes.append(f"no engine series for its children ({', '.join(shared.children) or 'none named'}): give "
                     "advise the engines' /metrics too, to value it")
    elif saved is None:
        notes.append("value not judged: the engines' prefill cost per token is not known")
    else:
        verdict = "NET NEGATIVE: its loads held the engines longer than they saved" if advice.net_negative else (
            "it pays")
        notes.append(f"summed over {shared.engines} engines it saved {saved:.3g} s of prefill, its loads held them "
                     f"{wait:.3g} s: net {saved - wait:+.3g} s; {verdict}")
    if knee is not None and capacity is not None and advice.hit_ratio_at_capacity is not None:
        at = f"at {capacity:,.0f} blocks the fleet's hit ratio is {advice.hit_ratio_at_capacity:.3f}"
        where = f"the fleet curve reaches {KNEE:.0%} of its ceiling {ceiling:.3f} at {knee:,.0f} blocks"
        if capacity < knee:
            notes.append(f"grow it to {knee:,.0f} blocks: {at}; {where}, hit ratio +"
                         f"{curve.at(knee) - advice.hit_ratio_at_capacity:.3f}")  # type: ignore[union-attr]
        elif capacity >= SHRINK_PAST_KNEE * knee:
            notes.append(f"it could shrink to {knee:,.0f} blocks: {at}; {where}, hit ratio -"
                         f"{advice.hit_ratio_at_capacity - curve.at(knee):.3f}")  # type: ignore[union-attr]
        else:
            notes.append(f"its size is right for the fleet's traffic: {at}; {where}")
    elif knee is not None:
        notes.append(f"capacity unknown (give kvcompose fleet --capacity): the fleet curve reaches {KNEE:.0%} of its "
                     f"ceiling {ceiling:.3f} at {knee:,.0f} blocks")
    return advice


def shared_lines(tiers: list[SharedTierAdvice], source: str) -> list[str]:
    lines = []
    for tier in tiers:
        children = ", ".join(tier.children) or "no child named"
        heading = (f"shared tier {tier.tier} (kvcompose fleet at {source}): {tier.engines} engines, as {children}; "
                   f"{tier.sampled_references:,.0f} sampled of {tier.references:,.0f} block references")
        lines += ["", heading]
        lines += [f"  - {note}" for note in tier.recommendations]
    return lines
