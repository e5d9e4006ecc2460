"""KVComposeStats: the composite's mergeable stats, keyed by child name.

The payload is plain data (it crosses processes as a dict)::

    {"children": {child: {"ops": {op: {"n": [per-bucket counts], "s": [per-bucket sums]}},
                          "errors": {op: {error_type: count}},
                          "counters": {counter: value}}},
     "native": {child: {"class": "module:Class", "stats": <the child's own stats dict>}},
     "breakers": {child: {"state": 0 closed | 1 open | 2 half-open, "opens": count}}}

Its size is bounded by children x operations x buckets, whatever the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvcompose.metrics.histogram import merge_histogram_payloads
from kvcompose.metrics.native import NativeStats

CHILDREN_KEY = "children"
NATIVE_KEY = "native"
BREAKERS_KEY = "breakers"


def _add_counts(mine: dict[str, int], theirs: dict[str, int]) -> dict[str, int]:
    return {key: mine.get(key, 0) + theirs.get(key, 0) for key in mine.keys() | theirs.keys()}


def merge_child_payloads(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Sum two payloads of one child; neither input is modified."""
    ops = dict(mine["ops"])
    for op, histogram in theirs["ops"].items():
        ops[op] = merge_histogram_payloads(ops[op], histogram) if op in ops else histogram
    errors = dict(mine["errors"])
    for op, by_type in theirs["errors"].items():
        errors[op] = _add_counts(errors.get(op, {}), by_type)
    return {"ops": ops, "errors": errors, "counters": _add_counts(mine["counters"], theirs["counters"])}


@dataclass
class KVComposeStats(KVConnectorStats):
    """Stats of every child, by pipeline name: kvcompose's own and the child's native ones."""

    data: dict[str, Any] = field(default_factory=dict)

    @property
    def children(self) -> dict[str, dict[str, Any]]:
        return self.data.setdefault(CHILDREN_KEY, {})

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
        return cls(data={CHILDREN_KEY: dict(payload.get(CHILDREN_KEY, {})), NATIVE_KEY: native,
                         BREAKERS_KEY: dict(payload.get(BREAKERS_KEY, {}))})

    def to_dict(self) -> dict[str, Any]:
        return {
            CHILDREN_KEY: self.children,
            NATIVE_KEY: {name: stats.to_dict() for name, stats in self.native.items()},
            BREAKERS_KEY: self.breakers,
        }

    def aggregate(self, other: KVConnectorStats) -> KVComposeStats:
        if not isinstance(other, KVComposeStats):
            other = KVComposeStats.from_payload(other.data)
        for name, payload in other.children.items():
            mine = self.children.get(name)
            self.children[name] = payload if mine is None else merge_child_payloads(mine, payload)
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
        self.children.clear()
        self.breakers.clear()
        for stats in self.native.values():
            stats.stats.reset()

    def reduce(self) -> dict[str, int | float]:
        """One line of numbers for vLLM's periodic log: calls and mean ms per child and op."""
        reduced: dict[str, int | float] = {}
        for name, payload in sorted(self.children.items()):
            counters = payload["counters"]
            reduced[f"{name}.lookup_hits"] = counters.get("lookup_hits", 0)
            reduced[f"{name}.lookup_misses"] = counters.get("lookup_misses", 0)
            reduced[f"{name}.loaded_tokens"] = counters.get("loaded_tokens", 0)
            for op, histogram in sorted(payload["ops"].items()):
                calls = sum(histogram["n"])
                reduced[f"{name}.{op}.calls"] = calls
                reduced[f"{name}.{op}.mean_ms"] = round(1000 * sum(histogram["s"]) / calls, 4) if calls else 0.0
        for name, stats in self.native.items():
            for key, value in stats.stats.reduce().items():
                reduced[f"{name}.{key}"] = value
        return reduced

    def is_empty(self) -> bool:
        return (
            not self.children and not self.breakers and all(stats.stats.is_empty() for stats in self.native.values())
        )
