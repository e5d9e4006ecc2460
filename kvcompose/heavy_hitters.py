"""The heaviest keys of an unbounded stream, in bounded memory: Space-Saving over time-decayed weights.

Space-Saving (Metwally, Agrawal and El Abbadi, "Efficient Computation of
Frequent and Top-k Elements in Data Streams", ICDT 2005) keeps ``capacity``
counters. A key that has one adds to it; a new key takes over the smallest
counter, inheriting its count as its error. Any key whose true weight is
above the total over ``capacity`` holds a counter, and a counter over-states
its key's weight by at most its error, so the top of the counters is the top
of the stream once the heavy keys stand clear of the smallest counter.

Weights decay with time (``half_life_s``): a weight added at ``t`` counts
``2 ** (t / half_life)`` times a weight added at 0, so comparing counters
compares weights decayed to any common time (forward decay: nothing has to be
rescaled per add). A key that grows climbs into the top and one that fades
falls out within a few half-lives.

Cost: an add is O(log capacity) amortised (a heap of counters whose stale
entries are skipped and rebuilt away), whatever the number of distinct keys.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Hashable

# Forward-decay weights grow as 2 ** (age / half-life); rescaled before they grow large.
_RENORMALISE_WEIGHT = 2.0**32
# The heap holds a fresh entry per add; it is rebuilt from the counters when it passes this many per counter.
_HEAP_ENTRIES_PER_COUNTER = 4


class HeavyHitters:
    """Space-Saving over decayed weights; see the module docstring. ``clock``: seconds (``now`` overrides it)."""

    def __init__(self, capacity: int, half_life_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if half_life_s is not None and half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.capacity = capacity
        self._half_life_s = half_life_s
        self._clock = clock
        self._epoch = clock()
        self._counts: dict[Hashable, float] = {}  # key -> its counter (weight since it took it, plus error)
        self._errors: dict[Hashable, float] = {}  # key -> the count it inherited: the most it over-states
        self._heap: list[tuple[float, int, Hashable]] = []  # (count, order, key); stale where count moved
        self._order = 0  # breaks ties in the heap without comparing keys

    def __len__(self) -> int:
        return len(self._counts)

    def add(self, key: Hashable, amount: float, now: float | None = None) -> None:
        """``amount`` more weight for ``key`` (``now``: when, in the clock's seconds); none is no change."""
        if amount <= 0:
            return
        weight = amount * self._decay_weight(self._clock() if now is None else now)
        counts = self._counts
        if key in counts:
            counts[key] += weight
        elif len(counts) < self.capacity:
            counts[key], self._errors[key] = weight, 0.0
        else:
            smallest, evicted = self._pop_smallest()
            del counts[evicted], self._errors[evicted]
            counts[key], self._errors[key] = smallest + weight, smallest
        self._push(key, counts[key])

    def top(self, k: int) -> list[Hashable]:
        """The ``k`` keys of the largest counters, largest first (ties: the smaller guaranteed weight last)."""
        if k <= 0:
            return []
        counts, errors = self._counts, self._errors
        return heapq.nlargest(k, counts, key=lambda key: (counts[key], counts[key] - errors[key]))

    def weight(self, key: Hashable) -> tuple[float, float]:
        """``key``'s counter and its error, decayed to the clock's now ((0, 0): no counter)."""
        scale = self._decay_weight(self._clock())
        return self._counts.get(key, 0.0) / scale, self._errors.get(key, 0.0) / scale

    def _decay_weight(self, now: float) -> float:
        if self._half_life_s is None:
            return 1.0
        weight = 2.0 ** ((now - self._epoch) / self._half_life_s)
        if weight > _RENORMALISE_WEIGHT:
            factor = 1.0 / weight
            self._counts = {key: count * factor for key, count in self._counts.items()}
            self._errors = {key: error * factor for key, error in self._errors.items()}
            self._rebuild_heap()
            self._epoch, weight = now, 1.0
        return weight

    def _push(self, key: Hashable, count: float) -> None:
        self._order += 1
        heapq.heappush(self._heap, (count, self._order, key))
        if len(self._heap) > _HEAP_ENTRIES_PER_COUNTER * self.capacity:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(count, order, key) for order, (key, count) in enumerate(self._counts.items())]
        self._order = len(self._heap)
        heapq.heapify(self._heap)

    def _pop_smallest(self) -> tuple[float, Hashable]:
        """The smallest counter and its key (stale heap entries skipped)."""
        heap, counts = self._heap, self._counts
        while True:
            count, _, key = heapq.heappop(heap)
            if counts.get(key) == count:
                return count, key
