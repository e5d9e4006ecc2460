"""EconomicsReport: what changed in a process's view of the tiers' economics, as the stats carry it.

The scheduler knows the engine's prefix-block stream (its hit-ratio curve by
cache size, from kvcompose.economics.shards), the GPU cache and each tier's
capacity (the GPU cache's is 0 with prefix caching off: it serves no prefix
hits), the reuse distances each loading tier serves, and the bytes of a
block; a worker measures what prefilling a token costs the engine. Each
reports what changed as an :class:`EconomicsReport` in its stats; merged
reports keep the latest of each figure (they are levels, not counts).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

GPU = "gpu"  # kvcompose_tier_capacity_blocks' connector label for the GPU cache


@dataclass
class EconomicsReport:
    """What changed in a process's view of the tiers' economics since its last report (None: unchanged)."""

    curve: list[list[float]] | None = None  # [size in blocks, estimated LRU hit ratio], by size
    capacities: dict[str, int] | None = None  # tier (or "gpu": 0 with prefix caching off) -> blocks it holds
    reaches: dict[str, list[int]] | None = None  # loading tier -> [start, end) of the reuse distances it serves
    block_bytes: int | None = None  # bytes of one KV block, over every layer and worker
    write_waste: dict[str, float] | None = None  # tier -> estimated share of its saved blocks never read from it
    prefill_seconds_per_token: float | None = None  # the engine's fitted marginal prefill cost per token

    def add(self, other: EconomicsReport) -> None:
        """Take ``other``'s figures where it has any: the later report of a level wins."""
        for each in fields(self):
            if (value := getattr(other, each.name)) is not None:
                setattr(self, each.name, value)

    def is_empty(self) -> bool:
        return all(getattr(self, each.name) is None for each in fields(self))

    def copy(self) -> EconomicsReport:
        return EconomicsReport(**self.to_dict())

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's log line: the prefill cost, when reported."""
        if self.prefill_seconds_per_token is None:
            return {}
        return {"prefill_us_per_token": round(self.prefill_seconds_per_token * 1e6, 3)}

    def to_dict(self) -> dict[str, Any]:
        return {each.name: getattr(self, each.name) for each in fields(self)}

    @classmethod
    def from_payload(cls, payload: EconomicsReport | dict[str, Any]) -> EconomicsReport:
        return payload if isinstance(payload, EconomicsReport) else cls(**payload)
