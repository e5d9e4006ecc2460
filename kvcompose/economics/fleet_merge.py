"""The fleet's curves: engines' sampled requests merged in time order into one SHARDS sampler per shared tier.

Every engine samples the keys whose keyed digest lies below one fixed
threshold (kvcompose.economics.fleet_samples), so a key is sampled on every
engine or on none: the engines' sampled requests, merged by time, are the
fleet's references to the sampled keys, and the per-engine sampler's own
code (``ReuseDistanceSampler.record_presampled``) turns them into the LRU
hit ratio of the shared tier at any size. Each request brings the block
references the engine saw since its previous sampled one, so the curve's
denominator is every reference of every engine naming the tier.

Order. A batch's requests wait until they are ``lateness_s`` old by the
aggregator's clock, then go in by their engine's time: an engine pulled late
(slow, or unreachable for a while) has its requests merged within that
lateness, and past it they go in as they come, counted as late. Nothing
waits for an engine that does not answer.

Agreement. The engines naming a tier must sample at one rate and agree on
their keys (the batch's probe, a keyed digest of their block-hash
configuration). Where they do not, the tier has no curve, and
:meth:`FleetMerger.disagreement` says which engines differ and how.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcompose.economics.sizes import GRID_HEADROOM, SMALLEST_GRID_SIZE, size_grid
from kvcompose.wire.fleet import FleetBatch, FleetPayloadError

if TYPE_CHECKING:
    from kvcompose.economics.shards import ReuseDistanceSampler

DEFAULT_LATENESS_S = 30.0
DEFAULT_MAX_SIZE_BLOCKS = 1 << 22
# The aggregator tracks more keys than an engine's sampler: it has the memory, and the fleet's curve reaches far.
DEFAULT_MAX_TRACKED_KEYS = 1 << 15
# A batch whose clock is further than this from the aggregator's is refused: its times would misplace it.
MAX_CLOCK_SKEW_S = 3600.0
# Requests waiting for their lateness to pass, at most; past it the oldest go in at once.
MAX_PENDING_REQUESTS = 1 << 20
# At rate R a sampled reuse distance d stands for d / R blocks: a size under a few sampled slots reads the
# distances' rounding, not the stream. The curve starts at this many slots (2,048 blocks at 1/256).
MIN_SAMPLED_SLOTS = 8


@dataclass
class EngineState:
    """What the aggregator knows of one target."""

    target: str
    engine: str | None = None
    instance: str | None = None
    cursor: int = 0  # the last sequence number taken
    references: int = 0  # the engine's block references accounted for
    tiers: dict[str, str] = field(default_factory=dict)
    sample_rate: float | None = None
    probe: str | None = None
    capacities: dict[str, int] = field(default_factory=dict)
    dropped: int = 0  # as the engine reports: requests its buffer dropped before any pull
    lost: int = 0  # requests this aggregator never got (a gap in the sequence numbers)
    up: bool = False  # its last pull succeeded
    failures: Counter[str] = field(default_factory=Counter)


# A request waiting to be merged: (time, arrival order, target, its tiers, block references, digests). A tuple,
# ordered by time then arrival (unique), so the heap compares in C.
_Pending = tuple[float, int, str, tuple[str, ...], int, tuple[int, ...]]


@dataclass
class TierState:
    """One shared tier's merged stream."""

    tier: str
    sample_rate: float
    sampler: ReuseDistanceSampler
    references: int = 0
    sampled_references: int = 0


class FleetMerger:
    """Merges the targets' batches; see the module docstring. Not thread-safe: one caller at a time."""

    def __init__(self, max_size_blocks: int = DEFAULT_MAX_SIZE_BLOCKS, lateness_s: float = DEFAULT_LATENESS_S,
                 half_life_s: float | None = 3600.0, max_tracked_keys: int = DEFAULT_MAX_TRACKED_KEYS,
                 capacities: dict[str, int] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.max_size_blocks = max_size_blocks
        self.lateness_s = lateness_s
        self.engines: dict[str, EngineState] = {}
        self.tiers: dict[str, TierState] = {}
        self.late_requests = 0
        self._half_life_s = half_life_s
        self._max_tracked_keys = max_tracked_keys
        self._capacities = dict(capacities or {})  # given to the aggregator: they win over the engines'
        self._clock = clock
        self._pending: list[_Pending] = []
        self._order = 0
        self._merged_until = -math.inf

    def engine(self, target: str) -> EngineState:
        if target not in self.engines:
            self.engines[target] = EngineState(target)
        return self.engines[target]

    def cursor(self, target: str) -> int:
        return self.engine(target).cursor

    def failed(self, target: str, reason: str) -> None:
        """A pull of ``target`` failed: ``reason`` is unreachable, timeout, http_error or bad_answer."""
        state = self.engine(target)
        state.up = False
        state.failures[reason] += 1

    def add(self, target: str, batch: FleetBatch) -> None:
        """A pull's answer; :class:`FleetPayloadError` (and nothing taken) when it contradicts what came before."""
        state = self.engine(target)
        now = self._clock()
        if abs(batch.time - now) > MAX_CLOCK_SKEW_S:
            raise FleetPayloadError(f"its clock is {batch.time - now:+.0f} s off the aggregator's")
        if any(abs(request.time - batch.time) > MAX_CLOCK_SKEW_S for request in batch.requests):
            raise FleetPayloadError("a request's time is over an hour from the batch's")
        same = batch.instance == state.instance
        cursor, references = (state.cursor, state.references) if same else (0, 0)
        if batch.requests and batch.requests[0].sequence <= cursor or batch.next < cursor:
            raise FleetPayloadError(f"sequence numbers go back (past {cursor})")
        if batch.references < references or (batch.requests and batch.requests[0].references < references):
            raise FleetPayloadError("its count of block references went down")
        first_available = batch.requests[0].sequence if batch.requests else batch.next + 1
        state.lost += max(0, first_available - cursor - 1)
        state.engine, state.instance, state.tiers = batch.engine, batch.instance, dict(batch.tiers)
        state.sample_rate, state.probe, state.capacities = batch.sample_rate, batch.probe, dict(batch.capacities)
        state.dropped, state.up = batch.dropped, True
        tiers = tuple(batch.tiers)
        for request in batch.requests:
            self._push(request.time, target, tiers, request.references - references, request.digests)
            references = request.references
        if batch.references > references:  # the references after its last sampled request
            self._push(batch.time, target, tiers, batch.references - references, ())
        state.cursor, state.references = batch.next, batch.references

    def _push(self, moment: float, target: str, tiers: tuple[str, ...], references: int,
              digests: tuple[int, ...]) -> None:
        if moment <= self._merged_until:
            self.late_requests += 1
            moment = self._merged_until  # keeps the order among the late
        self._order += 1
        heapq.heappush(self._pending, (moment, self._order, target, tiers, references, digests))

    def merge(self, now: float | None = None) -> int:
        """Feed the requests older than the lateness (or, past the pending limit, the oldest) to the tiers'
        samplers, in time order; ``now=math.inf`` feeds them all. Returns how many went in."""
        horizon = (self._clock() if now is None else now) - self.lateness_s
        pending, merged = self._pending, 0
        while pending and (pending[0][0] <= horizon or len(pending) > MAX_PENDING_REQUESTS):
            moment, _, target, tiers, references, digests = heapq.heappop(pending)
            self._merged_until = max(self._merged_until, moment)
            rate = self.engines[target].sample_rate or 0.0
            for tier in tiers:
                state = self._tier(tier, rate)
                if state.sample_rate != rate:
                    continue  # samples at another rate do not merge; disagreement() says so
                state.sampler.record_presampled(digests, references, now=moment)
                state.references += references
                state.sampled_references += len(digests)
            merged += 1
        return merged

    def _tier(self, tier: str, rate: float) -> TierState:
        if tier not in self.tiers:
            # Here, not at the top: the sampler imports numpy, which the kvcompose command line does not load.
            from kvcompose.economics.shards import ReuseDistanceSampler

            sampler = ReuseDistanceSampler(self.max_size_blocks, max_tracked_keys=self._max_tracked_keys,
                                           sample_rate=rate, full_sample_references=0,
                                           half_life_s=self._half_life_s, clock=self._clock)
            self.tiers[tier] = TierState(tier, rate, sampler)
        return self.tiers[tier]

    # -- reading ---------------------------------------------------------------------------------------------

    def engines_of(self, tier: str) -> list[EngineState]:
        return [state for state in self.engines.values() if tier in state.tiers]

    def disagreement(self, tier: str) -> str | None:
        """Why the engines naming ``tier`` cannot be merged (one line), or None when they can."""
        engines = self.engines_of(tier)
        rates = {state.sample_rate for state in engines}
        if len(rates) > 1:
            return (f"tier {tier}: engines sample at different rates ({_grouped(engines, 'sample_rate')}): give "
                    "every pipeline naming it the same fleet.sample_rate")
        probes = {state.probe for state in engines if state.probe is not None}
        if len(probes) > 1:
            return (f"tier {tier}: engines' block keys cannot agree ({_grouped(engines, 'probe')}): their block "
                    "hashes or fleet secrets differ; give every engine the same PYTHONHASHSEED (or none, with "
                    "vLLM's default sha256), prefix_caching_hash_algo, block size and fleet secret")
        return None

    def capacity(self, tier: str) -> int | None:
        """The tier's capacity in blocks: as given to the aggregator, else the largest an engine reported."""
        if tier in self._capacities:
            return self._capacities[tier]
        reported = [state.capacities[tier] for state in self.engines_of(tier) if tier in state.capacities]
        return max(reported) if reported else None

    def sizes(self, tier: str) -> list[int]:
        """The sizes the tier's curve is read at: powers of two from :data:`MIN_SAMPLED_SLOTS` sampled slots up
        to several times its capacity, and its capacity."""
        capacity = self.capacity(tier)
        configured = [capacity] if capacity and capacity <= self.max_size_blocks else []
        state = self.tiers.get(tier)
        smallest = SMALLEST_GRID_SIZE
        if state is not None:
            smallest = max(smallest, 1 << math.ceil(math.log2(MIN_SAMPLED_SLOTS / state.sampler.rate)))
        grid = size_grid(configured or [self.max_size_blocks // GRID_HEADROOM], smallest=smallest)
        return [size for size in grid if size <= self.max_size_blocks]

    def curve(self, tier: str, sizes: Sequence[int] | None = None) -> list[tuple[int, float]]:
        """``(size in blocks, hit ratio)`` of an LRU cache of each size on the fleet's stream to ``tier``;
        empty when its engines disagree or nothing was merged yet."""
        state = self.tiers.get(tier)
        if state is None or state.references == 0 or self.disagreement(tier) is not None:
            return []
        sizes = list(sizes if sizes is not None else self.sizes(tier))
        return list(zip(sizes, state.sampler.hit_ratio(sizes), strict=True))

    def known_tiers(self) -> list[str]:
        return sorted({tier for state in self.engines.values() for tier in state.tiers})


def _grouped(engines: list[EngineState], attribute: str) -> str:
    groups: dict[object, list[str]] = {}
    for state in engines:
        groups.setdefault(getattr(state, attribute), []).append(state.engine or state.target)
    return "; ".join(f"{attribute} {value} on {', '.join(sorted(names))}" for value, names in groups.items())
