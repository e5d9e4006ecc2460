"""A fixed-bucket latency histogram that keeps a count and a sum per bucket.

Per-bucket sums let the front-end replay the exact bucket counts and the
exact ``_sum`` into any Prometheus histogram with the same bounds (observing
each bucket's mean value, which lies inside the bucket, count times).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from operator import add
from typing import Any


class BucketHistogram:
    """Mutable, single-threaded; one per (child, operation) in a process."""

    __slots__ = ("bounds", "counts", "sums")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last bucket is +Inf
        self.sums = [0.0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        index = bisect_left(self.bounds, seconds)  # bucket i holds bounds[i-1] < v <= bounds[i]
        self.counts[index] += 1
        self.sums[index] += seconds

    def take(self) -> dict[str, list[Any]] | None:
        """Counts and sums since the last take (None if none), then zero them."""
        if not any(self.counts):
            return None
        payload = {"n": self.counts, "s": self.sums}
        self.counts = [0] * len(payload["n"])
        self.sums = [0.0] * len(payload["s"])
        return payload


def merge_histogram_payloads(mine: dict[str, list[Any]], theirs: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Bucket-wise sums (``map(add)``: once per child, operation and worker each step, so it is kept tight)."""
    if len(mine["n"]) != len(theirs["n"]) or len(mine["s"]) != len(theirs["s"]):
        raise ValueError("cannot merge histograms with different bucket bounds")
    return {"n": list(map(add, mine["n"], theirs["n"])), "s": list(map(add, mine["s"], theirs["s"]))}


def quantile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """Prometheus-style ``histogram_quantile``: linear within the bucket."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(counts):
        if seen + count >= rank and count:
            if index == len(bounds):  # +Inf bucket: the highest finite bound
                return bounds[-1]
            lower = bounds[index - 1] if index else 0.0
            return lower + (bounds[index] - lower) * (rank - seen) / count
        seen += count
    return bounds[-1]
