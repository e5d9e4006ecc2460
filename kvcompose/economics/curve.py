"""Reading an exported hit-ratio curve: between its sizes, its ceiling, where it flattens, its slope.

The curve arrives as points (``kvcompose_cache_size_hit_ratio{size_blocks}``),
powers of two plus the configured sizes. Between two points it is read
linearly in the logarithm of the size, the way it is drawn; below the
smallest point, linearly from an empty cache (no hits); past the largest, flat.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Curve:
    sizes: tuple[int, ...]  # blocks, ascending
    ratios: tuple[float, ...]

    @classmethod
    def from_points(cls, points: Mapping[int, float]) -> Curve | None:
        """The curve through ``{size_blocks: hit ratio}``; None without a point of positive size."""
        kept = sorted((size, ratio) for size, ratio in points.items() if size > 0 and not math.isnan(ratio))
        if not kept:
            return None
        return cls(tuple(size for size, _ in kept), tuple(ratio for _, ratio in kept))

    @property
    def ceiling(self) -> float:
        """The most an LRU cache of any size on the grid hits: every reference but the first ones."""
        return max(self.ratios)

    def at(self, size: float) -> float:
        if size <= 0:
            return 0.0
        index = bisect_left(self.sizes, size)
        if index == len(self.sizes):
            return self.ratios[-1]
        if self.sizes[index] == size:
            return self.ratios[index]
        if index == 0:
            return self.ratios[0] * size / self.sizes[0]
        lower, upper = self.sizes[index - 1], self.sizes[index]
        share = math.log(size / lower) / math.log(upper / lower)
        return self.ratios[index - 1] + share * (self.ratios[index] - self.ratios[index - 1])

    def size_reaching(self, fraction_of_ceiling: float) -> float:
        """The smallest size, in blocks, at which the curve reaches ``fraction_of_ceiling`` of its ceiling."""
        target = fraction_of_ceiling * self.ceiling
        previous_size, previous_ratio = 0.0, 0.0
        for size, ratio in zip(self.sizes, self.ratios, strict=True):
            if ratio >= target:  # and the previous point was below it
                if previous_size == 0:
                    return size * target / ratio if ratio > 0 else float(size)
                share = (target - previous_ratio) / (ratio - previous_ratio)
                return previous_size * (size / previous_size) ** share
            previous_size, previous_ratio = size, ratio
        return float(self.sizes[-1])

    def next_size_above(self, size: float) -> int | None:
        """The first point past ``size``, None past the last: where a slope at ``size`` is read to."""
        index = bisect_left(self.sizes, size)
        if index < len(self.sizes) and self.sizes[index] == size:
            index += 1
        return self.sizes[index] if index < len(self.sizes) else None
