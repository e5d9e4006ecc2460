"""Cache sizes for a miss-ratio curve: the grid it is read at, what each tier serves, blocks in bytes.

Under vLLM's chained prefix hashes an LRU cache keeps prefixes whole, so a
cache of ``S`` blocks serves the block references whose reuse distance is
under ``S`` (kvcompose.economics.shards). A tier of ``T`` blocks below a GPU
cache of ``G`` blocks holds what the engine computed most recently, so the
GPU cache and the tier act as one LRU cache of ``G + T`` blocks: the tier
serves the distances in ``[G, G + T)`` and adds ``hit(G + T) - hit(G)`` to
the hit ratio. That band is the tier's reach. With prefix caching off the GPU
cache serves no prefix hits: ``G`` is 0 and the tier serves ``[0, T)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

GIB = 1 << 30
SMALLEST_GRID_SIZE = 256
# The grid runs to at least this many times the largest configured size, so the curve shows what growing a tier
# several-fold would buy and where it flattens.
GRID_HEADROOM = 8


@dataclass(frozen=True)
class Reach:
    """The reuse distances, in blocks, whose references a tier serves: ``start <= distance < end``; none when
    ``start == end`` (an earlier tier at least as large serves them all)."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"a reach needs 0 <= start <= end, got [{self.start}, {self.end})")

    @property
    def empty(self) -> bool:
        return self.start == self.end


def tier_reaches(gpu_blocks: int, tier_blocks: Sequence[int | None]) -> list[Reach | None]:
    """Each loading tier's reach below a GPU cache serving prefix hits from ``gpu_blocks`` (0 with prefix
    caching off), tiers in the order they are asked to load; None where it is unknown.

    kvcompose's children all receive every save (vLLM's MultiConnector semantics), so each holds the last
    blocks written, as many as fit: the first tier to have a block is the smallest one large enough. A tier
    serves the distances past every earlier tier and within itself; a tier no larger than an earlier one
    serves none (an empty reach), and every tier after one of unknown size (None in ``tier_blocks``) has an
    unknown reach. The bands are per block, whatever the load policy: under ``longest_match`` the tier
    holding a request's longest prefix loads it all, under ``first_match`` the first tier holding any of it
    loads its part, and the request recomputes the blocks a later tier held beyond that (counted as tokens
    forgone), so there a later tier's band is what it would serve at most."""
    reaches: list[Reach | None] = []
    covered: int | None = gpu_blocks
    for blocks in tier_blocks:
        if covered is None or blocks is None:
            reaches.append(None)
            covered = None
            continue
        end = gpu_blocks + blocks
        reaches.append(Reach(covered, max(covered, end)))
        covered = max(covered, end)
    return reaches


def size_grid(configured_sizes: Iterable[int], smallest: int = SMALLEST_GRID_SIZE,
              headroom: int = GRID_HEADROOM) -> list[int]:
    """Sizes, in blocks, to read the curve at: powers of two from ``smallest`` up to the first one at least
    ``headroom`` times the largest configured size, plus the configured sizes themselves (the GPU cache's,
    each tier's, and sums of them such as a tier's reach), ascending and without repeats."""
    configured = {int(size) for size in configured_sizes if size > 0}
    largest = max(configured, default=smallest)
    sizes = set(configured)
    power = smallest
    while True:
        sizes.add(power)
        if power >= headroom * largest:
            break
        power *= 2
    return sorted(sizes)


def blocks_to_bytes(blocks: float, block_bytes: int) -> float:
    return blocks * block_bytes


def blocks_to_gib(blocks: float, block_bytes: int) -> float:
    return blocks * block_bytes / GIB


def bytes_to_blocks(size_bytes: float, block_bytes: int) -> int:
    """Whole blocks that fit in ``size_bytes``."""
    return int(size_bytes // block_bytes)
