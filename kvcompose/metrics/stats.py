"""KVComposeStats: the composite's mergeable stats, keyed by child name.

``data`` holds kvcompose's own :class:`CallTable` of every child's calls, each
child's native stats and its circuit breaker's report. It crosses processes
as plain data (``to_dict``)::

    {"calls": <CallTable.to_dict()> | None,
     "native": {child: {"class": "module:Class", "stats": <the child's own stats dict>}},
     "breakers": {child: {"state": 0 closed | 1 open | 2 half-open, "opens": count}}}

Its size is bounded by children x operations x buckets, whatever the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvcompose.metrics.native import NativeStats
from kvcompose.metrics.table import CallTable

CALLS_KEY = "calls"
NATIVE_KEY = "native"
BREAKERS_KEY = "breakers"


@dataclass
class KVComposeStats(KVConnectorStats):
    """Stats of every child, by pipeline name: kvcompose's own and the child's native ones."""

    data: dict[str, Any] = field(default_factory=dict)

    @property
    def calls(self) -> CallTable | None:
        return self.data.get(CALLS_KEY)

    @calls.setter
    def calls(self, table: CallTable | None) -> None:
        self.data[CALLS_KEY] = table

    @property
    def native(self) -> dict[str, NativeStats]:
        return self.data.setdefault(NATIVE_KEY, {})

    @property
    def breakers(self) -> dict[str, dict[str, int]]:
        return self.data.setdefault(BREAKERS_KEY, {})

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> KVComposeStats:
        """Rebuild from a payload that crossed a process boundary (or not)."""
        native = {}
        for name, entry in payload.get(NATIVE_KEY, {}).items():
            if (stats := NativeStats.from_payload(entry)) is not None:
                native[name] = stats
        calls = payload.get(CALLS_KEY)
        if isinstance(calls, dict):
            calls = CallTable.from_dict(calls)
        return cls(data={CALLS_KEY: calls, NATIVE_KEY: native, BREAKERS_KEY: dict(payload.get(BREAKERS_KEY, {}))})

    def to_dict(self) -> dict[str, Any]:
        return {
            CALLS_KEY: self.calls.to_dict() if self.calls is not None else None,
            NATIVE_KEY: {name: stats.to_dict() for name, stats in self.native.items()},
            BREAKERS_KEY: self.breakers,
        }

    def aggregate(self, other: KVConnectorStats) -> KVComposeStats:
        if not isinstance(other, KVComposeStats):
            other = KVComposeStats.from_payload(other.data)
        if other.calls is not None:
            if self.calls is None:
                self.calls = CallTable(other.calls.children, other.calls.buckets)
            self.calls.add(other.calls)
        for name, stats in other.native.items():
            mine_native = self.native.get(name)
            self.native[name] = stats if mine_native is None else mine_native.merged(stats)
        for name, breaker in other.breakers.items():
            mine_breaker = self.breakers.get(name)
            # The worst state of any process (scheduler, workers) shows.
            self.breakers[name] = breaker if mine_breaker is None else {
                "state": max(mine_breaker["state"], breaker["state"]),
                "opens": mine_breaker["opens"] + breaker["opens"],
            }
        return self

    def reset(self) -> None:
        self.calls = None
        self.breakers.clear()
        for stats in self.native.values():
            stats.stats.reset()

    def reduce(self) -> dict[str, int | float]:
        """One line of numbers for vLLM's periodic log: calls and mean ms per child and op."""
        reduced = self.calls.reduce() if self.calls is not None else {}
        for name, stats in self.native.items():
            for key, value in stats.stats.reduce().items():
                reduced[f"{name}.{key}"] = value
        return reduced

    def is_empty(self) -> bool:
        return (
            (self.calls is None or self.calls.is_empty())
            and not self.breakers
            and all(stats.stats.is_empty() for stats in self.native.values())
        )
