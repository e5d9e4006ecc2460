"""KVComposeStats: the composite's mergeable stats, keyed by child name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvcompose.metrics.native import NativeStats

NATIVE_KEY = "native"


@dataclass
class KVComposeStats(KVConnectorStats):
    """Stats of every child, by pipeline name.

    ``data[NATIVE_KEY][child]`` is that child's own stats (a
    :class:`NativeStats`), merged with its class's own ``aggregate``.
    """

    data: dict[str, Any] = field(default_factory=dict)

    @property
    def native(self) -> dict[str, NativeStats]:
        return self.data.setdefault(NATIVE_KEY, {})

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> KVComposeStats:
        """Rebuild from a payload that crossed a process boundary (or not)."""
        native = {}
        for name, entry in payload.get(NATIVE_KEY, {}).items():
            if (stats := NativeStats.from_payload(entry)) is not None:
                native[name] = stats
        return cls(data={NATIVE_KEY: native})

    def to_dict(self) -> dict[str, Any]:
        return {NATIVE_KEY: {name: stats.to_dict() for name, stats in self.native.items()}}

    def aggregate(self, other: KVConnectorStats) -> KVComposeStats:
        if not isinstance(other, KVComposeStats):
            other = KVComposeStats.from_payload(other.data)
        for name, stats in other.native.items():
            mine = self.native.get(name)
            self.native[name] = stats if mine is None else mine.merged(stats)
        return self

    def reset(self) -> None:
        for stats in self.native.values():
            stats.stats.reset()

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {}
        for name, stats in self.native.items():
            for key, value in stats.stats.reduce().items():
                reduced[f"{name}.{key}"] = value
        return reduced

    def is_empty(self) -> bool:
        return all(stats.stats.is_empty() for stats in self.native.values())
