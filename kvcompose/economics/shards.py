"""What an LRU cache of any size would hit on the engine's prefix-block stream: fixed-size SHARDS.

SHARDS (Waldspurger et al., "Efficient MRC Construction with SHARDS", FAST
2015) estimates an LRU miss-ratio curve from a spatial sample of the keys:
a key is sampled when its hash lies below a threshold, so every reference to
a sampled key is seen and reuse distances among sampled keys, divided by the
sampling rate, estimate the true ones. vLLM's block hashes are already
uniform (SHA-256 or xxHash of the block and its parent's hash), so their
first eight bytes, read big-endian, serve as the sampling hash: nothing is
hashed again.

This is the fixed-size variant with adjustment:

- At most ``max_tracked_keys`` keys are tracked. When new keys pass that,
  the threshold drops to keep the smallest seven eighths of the tracked
  keys (the paper evicts the largest one at a time; a batch keeps the cost
  amortised), and the rate with it. A sampled reference weighs the inverse
  of the rate when it was seen.
- The expected count of sampled references (every reference, weighed) less
  the count actually sampled is added to the smallest distance: the paper's
  correction for the few hot keys that happen to be sampled or not.

The rate starts at 1: the first ``full_sample_references`` block references
are all sampled, so a young engine's curve is exact (and a short test
stream's). Past that, the rate falls as the stream grows, keeping about
that many references sampled, down to ``sample_rate``, where it settles
unless the key limit needs it lower. The settled rate is what bounds the CPU
per request; the fall costs a fraction of a CPU second once per engine.

Memory stays bounded whatever the traffic, and by more than the key limit: a
key whose stack depth passed the largest size the curve is read at will be
a miss at every size when it comes back, so it is dropped (and counted cold
if it returns). That also stops an endless stream of new keys from dragging
the rate towards zero: it settles near ``max_tracked_keys / max_size``.

The stream. A request's blocks are recorded tail first and root last, as
vLLM's own caches order them (the GPU cache frees a request's blocks in
reverse so its tail is evicted first; the CPU offloading LRU touches a
request's keys in reverse). A block's parent is then always used more
recently than the block, so an LRU cache holds whole prefixes and a
block-level hit is a prefix hit: the curve at ``S`` blocks is the share of
block references an LRU prefix cache of ``S`` blocks would serve.

The window. The histogram decays with time, by references' age in seconds
(``half_life_s``), not by their count: the curve then weighs traffic the way
a rate over the same hours does, so it can be compared with the tiers'
measured hit ratios over that window, and its span does not stretch and
shrink with load. Quiet hours change nothing (a uniform decay leaves every
ratio as it was); when traffic changes, the curve follows within a few
half-lives. The LRU stack itself is not windowed: what a cache holds depends
on the references, not on the clock.

One instance belongs to one thread (vLLM's scheduler): ``record`` is not
safe to call from two threads at once. The readers copy what they read, so a
stats thread may call them while the scheduler records (under the GIL each
sees a histogram at most one request stale).

Tenants. A reference may be attributed to a tenant (``record(..., tenant=)``): the one sampler then
also keeps each tenant's histogram of the reuse distances of its references in the shared stack, so a
tenant's curve (``hit_ratio(sizes, tenant=)``) is the share of its references an LRU cache of each size,
shared by every tenant, would serve. The caller bounds the tenants (``merge_tenant`` folds one into
another): each costs one histogram.

No key is ever logged or exported: only distances leave this object.
"""

from __future__ import annotations

import math
import sys
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from itertools import accumulate

import numpy as np

from kvcompose.economics.sizes import Reach

KEY_SPACE = 1 << 64
# SHARDS' fixed-size experiments track 8K keys (errors around 0.01); under 2 MiB here.
DEFAULT_MAX_TRACKED_KEYS = 8192
# Settled, the sampler costs under 2% of vLLM's own block hashing at 100-block prompts (benchmarks/economics.py).
DEFAULT_SAMPLE_RATE = 1.0 / 64
DEFAULT_FULL_SAMPLE_REFERENCES = 1 << 16
DEFAULT_HALF_LIFE_S = 3600.0
# Log-spaced histogram bins per doubling of the reuse distance: sizes between bin edges are interpolated.
BINS_PER_OCTAVE = 32
# Weights grow as 2 ** (age / half-life) instead of old ones shrinking; rescaled before they grow large.
_RENORMALISE_WEIGHT = 2.0**32
_KEEP_ON_LOWERING = 7 / 8
# From about this many blocks, block_keys and a numpy comparison beat comparing the hashes' bytes one by one.
_VECTORISE_FROM_BLOCKS = 768
_EMPTY_KEYS = np.empty(0, dtype=np.uint64)


def block_keys(block_hashes: Sequence[bytes]) -> np.ndarray:
    """A request's block keys: the first eight bytes of each of vLLM's block hashes as a big-endian uint64, in
    order, without hashing again or looping in Python (the hashes are joined and read one stride apart).

    ``Request.block_hashes`` (vLLM 0.30-0.33) is a list of ``BlockHash``, a ``NewType`` of bytes: 32 bytes of
    SHA-256 by default, 16 of xxHash. ``ReuseDistanceSampler.record_hashes`` takes the list itself and is
    cheaper for short prompts; this is for callers that want the keys."""
    if not block_hashes:
        return _EMPTY_KEYS
    width = len(block_hashes[0])
    joined = b"".join(block_hashes)
    if width < 8 or len(joined) != width * len(block_hashes):
        raise ValueError("block hashes must share one width of at least 8 bytes")
    big_endian = np.ndarray((len(block_hashes),), dtype=">u8", buffer=joined, strides=(width,))
    return big_endian.astype(np.uint64)


class ReuseDistanceSampler:
    """Fixed-size SHARDS over one engine's prefix-block stream: an LRU hit-ratio curve and write waste.

    ``max_size_blocks``: the largest size the curve will be read at (the top of ``sizes.size_grid``).
    ``reaches``: the tiers whose write waste to keep, as the reuse distances each serves (``sizes.tier_reaches``).
    ``sample_rate``: the rate the sampler settles at on a long stream; it bounds the CPU per request.
    ``full_sample_references``: block references sampled in full before the rate starts to fall.
    ``half_life_s``: how fast old references fade from the curve; None keeps them all.
    ``clock``: seconds, for the window (``now`` overrides it per call).
    """

    def __init__(self, max_size_blocks: int, *, reaches: Sequence[Reach] = (),
                 max_tracked_keys: int = DEFAULT_MAX_TRACKED_KEYS, sample_rate: float = DEFAULT_SAMPLE_RATE,
                 full_sample_references: int = DEFAULT_FULL_SAMPLE_REFERENCES,
                 half_life_s: float | None = DEFAULT_HALF_LIFE_S, clock: Callable[[], float] = time.monotonic):
        if max_size_blocks < 1:
            raise ValueError(f"max_size_blocks must be at least 1, got {max_size_blocks}")
        if max_tracked_keys < 16:
            raise ValueError(f"max_tracked_keys must be at least 16, got {max_tracked_keys}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if full_sample_references < 0:
            raise ValueError(f"full_sample_references must be at least 0, got {full_sample_references}")
        if half_life_s is not None and half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        for reach in reaches:
            if reach.end > max_size_blocks:
                raise ValueError(f"reach [{reach.start}, {reach.end}) passes max_size_blocks {max_size_blocks}")
        self.max_size_blocks = max_size_blocks
        self.max_tracked_keys = max_tracked_keys
        self.sample_rate = sample_rate
        self.full_sample_references = full_sample_references
        self.reaches = tuple(reaches)
        self.stream_references = 0  # every block reference since the start, undecayed
        self._settled_threshold = int(sample_rate * KEY_SPACE)
        self._half_life_s = half_life_s
        self._clock = clock
        self._epoch = clock()
        # A tracked key's value is the tick of its last reference shifted left past one bit per reach, set when
        # that reference missed a cache as large as the reach's end: the block was written to that tier.
        self._flag_bits = len(self.reaches)
        self._all_flags = (1 << self._flag_bits) - 1
        self._recency: OrderedDict[int, int] = OrderedDict()  # key -> packed tick, least recent first
        self._ticks: list[int] = []  # the tracked keys' last ticks, ascending: a key's rank is its stack depth
        self._tick = 0
        self._edges = [0.0, *(2.0 ** (b / BINS_PER_OCTAVE)
                              for b in range(math.ceil(BINS_PER_OCTAVE * math.log2(max_size_blocks)) + 1))]
        self._edges[-1] = max(self._edges[-1], float(max_size_blocks))
        self._distance_weights = [0.0] * len(self._edges)  # bin b: [edge b, edge b+1); the last: beyond the curve
        self._sampled_weight = 0.0
        self._references = 0.0
        # Sampled references by the reaches they wrote to (a bit set), and by the reaches they read from.
        self._written_by_flags = [0.0] * (self._all_flags + 1)
        self._read_by_flags = [0.0] * (self._all_flags + 1)
        # Per tenant: [its distance weights by bin, its references (weighed), its sampled weight].
        self._tenants: dict[Hashable, _TenantFigures] = {}
        self._set_threshold(KEY_SPACE - 1)

    # -- recording ---------------------------------------------------------------------------------------------

    def record_hashes(self, block_hashes: Sequence[bytes], now: float | None = None,
                      tenant: Hashable | None = None) -> None:
        """One request's ``Request.block_hashes``, root first, as the request asks for them.

        A hash is sampled when its bytes sort below the threshold's eight big-endian bytes, which is when its
        key (``block_keys``) lies below the threshold: only sampled hashes become integers. Long prompts go
        through ``block_keys`` instead, whose vectorised comparison is the cheaper there. ``tenant``: whose
        references they are (None: nobody's)."""
        if len(block_hashes) >= _VECTORISE_FROM_BLOCKS:
            self.record(block_keys(block_hashes), now, tenant)
            return
        weight = self._count_references(len(block_hashes), now, tenant)
        below = self._threshold_bytes
        sampled = [block_hash for block_hash in block_hashes if block_hash < below]
        if sampled:
            self._record_sampled([int.from_bytes(block_hash[:8], "big") for block_hash in reversed(sampled)],
                                 weight / self.rate, tenant)

    def record(self, keys: np.ndarray, now: float | None = None, tenant: Hashable | None = None) -> None:
        """One request's block keys (``block_keys``), root first; ``tenant``: whose (None: nobody's)."""
        weight = self._count_references(len(keys), now, tenant)
        sampled = keys[keys < self._numpy_threshold]
        if sampled.size:
            self._record_sampled(sampled[::-1].tolist(), weight / self.rate, tenant)

    def record_presampled(self, keys: Sequence[int], references: int, now: float | None = None) -> None:
        """Keys sampled before they got here, root first, among ``references`` block references: the merged
        samples of a fleet's engines, each of which kept the keys below one fixed threshold, this sampler's
        settled rate. Such a stream has no full sample to begin with: the rate starts settled (and the key
        limit may still lower it, as it does for a local stream)."""
        if self._threshold > self._settled_threshold:
            self._lower_threshold(self._settled_threshold)
        weight = self._count_references(references, now)
        threshold = self._threshold
        kept = [key for key in reversed(keys) if key < threshold]
        if kept:
            self._record_sampled(kept, weight / self.rate)

    def _count_references(self, count: int, now: float | None, tenant: Hashable | None = None) -> float:
        """Count a request's block references (``tenant``'s too); the weight of references made ``now``."""
        weight = self._weight(self._clock() if now is None else now)
        self._references += weight * count
        self.stream_references += count
        if tenant is not None:
            self._tenant(tenant).references += weight * count
        return weight

    def _tenant(self, tenant: Hashable) -> _TenantFigures:
        if (figures := self._tenants.get(tenant)) is None:
            figures = self._tenants[tenant] = _TenantFigures([0.0] * len(self._distance_weights))
        return figures

    def _record_sampled(self, keys: list[int], weight: float, tenant: Hashable | None = None) -> None:
        """Sampled keys, tail first: each one's reuse distance (also in ``tenant``'s histogram), and whether it
        reads or writes each reach."""
        recency, ticks, flag_bits, all_flags = self._recency, self._ticks, self._flag_bits, self._all_flags
        bin_of_depth, written_at_depth, served_at_depth = self._bin_of_depth, self._written_at, self._served_at
        distances, written, read = self._distance_weights, self._written_by_flags, self._read_by_flags
        deepest, beyond = len(bin_of_depth) - 1, len(distances) - 1
        own = None
        if tenant is not None:
            figures = self._tenant(tenant)
            figures.sampled += weight * len(keys)
            own = figures.distances
        tick = self._tick
        for key in keys:
            tick += 1
            previous = recency.pop(key, None)
            if previous is None:  # a first reference (or one dropped past the curve): a miss at every size
                distance_bin = beyond
                flags = all_flags
            else:
                rank = bisect_left(ticks, previous >> flag_bits)
                depth = len(ticks) - 1 - rank  # tracked keys used since: the sampled reuse distance
                del ticks[rank]
                depth = min(depth, deepest)
                distance_bin = bin_of_depth[depth]
                flags = written_at_depth[depth]
                # Reaches the block was written to at its last reference and that serve this distance.
                read[previous & served_at_depth[depth]] += weight
            distances[distance_bin] += weight
            if own is not None:
                own[distance_bin] += weight
            written[flags] += weight
            ticks.append(tick)
            recency[key] = (tick << flag_bits) | flags
        self._tick = tick
        self._sampled_weight += weight * len(keys)
        self._bound()

    def _weight(self, now: float) -> float:
        if self._half_life_s is None:
            return 1.0
        weight = 2.0 ** ((now - self._epoch) / self._half_life_s)
        if weight > _RENORMALISE_WEIGHT:
            self._rescale(1.0 / weight)
            self._epoch, weight = now, 1.0
        return weight

    def _rescale(self, factor: float) -> None:
        self._distance_weights = [w * factor for w in self._distance_weights]
        self._written_by_flags = [w * factor for w in self._written_by_flags]
        self._read_by_flags = [w * factor for w in self._read_by_flags]
        self._sampled_weight *= factor
        self._references *= factor
        for figures in self._tenants.values():
            figures.distances[:] = [w * factor for w in figures.distances]
            figures.references *= factor
            figures.sampled *= factor

    # -- bounding the tracked keys -----------------------------------------------------------------------------

    def _set_threshold(self, threshold: int) -> None:
        self._threshold = threshold
        self._threshold_bytes = threshold.to_bytes(8, "big")
        self._numpy_threshold = np.uint64(threshold)
        self.rate = threshold / KEY_SPACE
        # Deeper than this, a key's next reuse is past every size the curve is read at.
        self._max_depth = min(math.ceil(self.max_size_blocks * self.rate), self.max_tracked_keys + 1)
        self._prune_above = self._max_depth + max(64, self._max_depth // 8)
        # Per sampled depth (the deepest standing for any deeper): its histogram bin, the reaches a reference
        # at that distance misses (writes to), and those it is served by.
        distances = np.arange(self._prune_above + 1) / self.rate
        distances[-1] = math.inf
        bins = np.searchsorted(np.asarray(self._edges), distances, side="right") - 1
        self._bin_of_depth = np.minimum(bins, len(self._edges) - 1).tolist()
        written = np.zeros(distances.size, dtype=np.int64)
        served = np.zeros(distances.size, dtype=np.int64)
        for index, reach in enumerate(self.reaches):
            written |= (distances >= reach.end) << index
            served |= ((distances >= reach.start) & (distances < reach.end)) << index
        self._written_at, self._served_at = written.tolist(), served.tolist()

    def _bound(self) -> None:
        """Lower the rate where the stream's length or the key limit asks for it; drop keys past the curve."""
        if self._threshold > self._settled_threshold:
            wanted = self.full_sample_references / self.stream_references
            if wanted <= self.sample_rate:
                self._lower_threshold(self._settled_threshold)
            elif wanted < self.rate * _KEEP_ON_LOWERING:
                self._lower_threshold(int(wanted * KEY_SPACE))
        if len(self._recency) > self.max_tracked_keys:
            # SHARDS' fixed-size step: keep the tracked keys with the smallest hashes.
            keys = np.fromiter(self._recency.keys(), dtype=np.uint64, count=len(self._recency))
            keep = int(self.max_tracked_keys * _KEEP_ON_LOWERING)
            self._lower_threshold(int(np.partition(keys, keep)[keep]))
        if len(self._ticks) > self._prune_above:
            excess = len(self._ticks) - self._max_depth
            for _ in range(excess):
                self._recency.popitem(last=False)
            del self._ticks[:excess]

    def _lower_threshold(self, threshold: int) -> None:
        """Sample keys under ``threshold`` from now on, and forget the tracked ones at or above it."""
        for key in [key for key in self._recency if key >= threshold]:
            del self._recency[key]
        self._ticks[:] = [packed >> self._flag_bits for packed in self._recency.values()]
        self._set_threshold(threshold)

    # -- reading -----------------------------------------------------------------------------------------------

    @property
    def references(self) -> float:
        """Block references in the window (decayed to now), the curve's denominator; 0 before the first."""
        return self._references / self._weight(self._clock())

    @property
    def tracked_keys(self) -> int:
        return len(self._recency)

    @property
    def tenants(self) -> list[Hashable]:
        """The tenants references were attributed to (and not merged away)."""
        return list(self._tenants)

    def merge_tenant(self, tenant: Hashable, into: Hashable) -> None:
        """Count ``tenant``'s references as ``into``'s from now on, and those before too."""
        if tenant == into or (figures := self._tenants.pop(tenant, None)) is None:
            return
        target = self._tenant(into)
        target.distances[:] = [a + b for a, b in zip(target.distances, figures.distances, strict=True)]
        target.references += figures.references
        target.sampled += figures.sampled

    def hit_ratio(self, sizes_in_blocks: Sequence[int], tenant: Hashable | None = None) -> list[float]:
        """The estimated hit ratio of an LRU cache of each size on the stream (first references miss); with
        ``tenant``, on that tenant's references, in the cache all tenants share.

        NaN before any reference. A size past ``max_size_blocks`` is an error: the sampler forgets keys
        deeper than that."""
        if tenant is None:
            total, weights, sampled = self._references, list(self._distance_weights), self._sampled_weight
        elif (figures := self._tenants.get(tenant)) is not None:
            total, weights, sampled = figures.references, list(figures.distances), figures.sampled
        else:
            total, weights, sampled = 0.0, [], 0.0
        if total <= 0:
            return [math.nan] * len(sizes_in_blocks)
        below = [0.0, *accumulate(weights)]  # below[b]: weight of distances under edge b
        # SHARDS' adjustment: the shortfall (or excess) of sampled references counts at distance zero.
        adjustment = total - sampled
        ratios = []
        for size in sizes_in_blocks:
            if size > self.max_size_blocks:
                raise ValueError(f"size {size} is past the sampler's max_size_blocks {self.max_size_blocks}")
            hits = (self._weight_below(size, weights, below) + adjustment) if size > 0 else 0.0
            ratios.append(min(1.0, max(0.0, hits / total)))
        return ratios

    def _weight_below(self, size: float, weights: list[float], below: list[float]) -> float:
        """Weight of reuse distances under ``size``, interpolated linearly within the bin holding it."""
        edges = self._edges
        index = bisect_left(edges, size, hi=len(edges) - 1)
        if edges[index] <= size:  # size is an edge, or the last one (max_size_blocks)
            return below[index]
        lower = edges[index - 1]
        return below[index - 1] + weights[index - 1] * (size - lower) / (edges[index] - lower)

    def write_waste(self, reach: Reach) -> float:
        """Of the blocks written to a tier serving ``reach`` (references that missed a cache of ``reach.end``
        blocks), the share whose next reference is not served by it: farther than ``reach.end``, nearer than
        ``reach.start`` (a cache above served it), or not within the window. NaN before any write."""
        bit = 1 << self.reaches.index(reach)
        written = sum(weight for flags, weight in enumerate(self._written_by_flags) if flags & bit)
        read = sum(weight for flags, weight in enumerate(self._read_by_flags) if flags & bit)
        # A read weighs as of when it happened, its write as of earlier: under the window's decay a read can
        # outweigh its write by 2 ** (gap / half-life), a hair for gaps of minutes under an hour's half-life.
        return max(0.0, (written - read) / written) if written > 0 else math.nan

    def memory_bytes(self) -> int:
        """Bytes held by the sampler's containers and the integers in them (CPython's own sizes)."""
        held = (self._recency, self._ticks, self._bin_of_depth, self._written_at, self._served_at,
                self._distance_weights, self._edges, self._tenants,
                *(figures.distances for figures in self._tenants.values()))
        ints = sum(sys.getsizeof(key) + sys.getsizeof(value) for key, value in self._recency.items())
        return sum(sys.getsizeof(container) for container in held) + ints


class _TenantFigures:
    """One tenant's share of the stream: its distance weights by bin, its references and its sampled weight."""

    __slots__ = ("distances", "references", "sampled")

    def __init__(self, distances: list[float]) -> None:
        self.distances = distances
        self.references = 0.0
        self.sampled = 0.0
