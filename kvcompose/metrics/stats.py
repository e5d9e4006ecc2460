"""KVComposeStats: the composite's mergeable stats, keyed by child name.

``data`` holds kvcompose's own :class:`CallTable` of every child's calls, its
:class:`TransferTable` of every child's transfers, each child's native stats,
its circuit breaker's report, and the span exporter's :class:`TelemetryCounters`.
It crosses processes as plain data (``to_dict``)::

    {"calls": <CallTable.to_dict()> | None,
     "transfers": <TransferTable.to_dict()> | None,
     "native": {child: {"class": "module:Class", "stats": <the child's own stats dict>}},
     "breakers": {child: {"state": 0 closed | 1 open | 2 half-open, "opens": count}},
     "telemetry": {"dropped": {reason: count}, "spans_queued": count | None, "exporter_restarts": count} | None}

Its size is bounded by children x (operations + directions) x buckets, whatever the traffic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvcompose.metrics.native import NativeStats
from kvcompose.metrics.table import CallTable
from kvcompose.metrics.telemetry import TelemetryCounters
from kvcompose.metrics.transfers import TransferTable

CALLS_KEY = "calls"
NATIVE_KEY = "native"
BREAKERS_KEY = "breakers"
TRANSFERS_KEY = "transfers"
TELEMETRY_KEY = "telemetry"


class _Addable(Protocol):
    def add(self, other: Any) -> None: ...


def _copied_table(table: Any) -> Any:
    """A CallTable or TransferTable of its own with ``table``'s counts."""
    copy = type(table)(table.children, table.buckets)
    copy.add(table)
    return copy


@dataclass
class KVComposeStats(KVConnectorStats):
    """Stats of every child, by pipeline name: kvcompose's own and the child's native ones."""

    data: dict[str, Any] = field(default_factory=dict)
    # (section, key) of tables and children's stats taken over from an ``other`` of :meth:`aggregate` as they are:
    # vLLM merges stats it then discards (the scheduler's into the workers', each step's into the log's), so the
    # copy that keeps ``other`` unmodified is made only if this object is merged into again.
    _borrowed: set[tuple[str, str]] = field(default_factory=set, init=False, repr=False, compare=False)

    @property
    def calls(self) -> CallTable | None:
        return self.data.get(CALLS_KEY)

    @calls.setter
    def calls(self, table: CallTable | None) -> None:
        self.data[CALLS_KEY] = table

    @property
    def transfers(self) -> TransferTable | None:
        return self.data.get(TRANSFERS_KEY)

    @transfers.setter
    def transfers(self, table: TransferTable | None) -> None:
        self.data[TRANSFERS_KEY] = table

    @property
    def telemetry(self) -> TelemetryCounters | None:
        return self.data.get(TELEMETRY_KEY)

    @telemetry.setter
    def telemetry(self, counters: TelemetryCounters | None) -> None:
        self.data[TELEMETRY_KEY] = counters

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
        transfers, telemetry = payload.get(TRANSFERS_KEY), payload.get(TELEMETRY_KEY)
        return cls(data={
            CALLS_KEY: calls,
            TRANSFERS_KEY: TransferTable.from_payload(transfers) if transfers is not None else None,
            NATIVE_KEY: native,
            BREAKERS_KEY: dict(payload.get(BREAKERS_KEY, {})),
            TELEMETRY_KEY: TelemetryCounters.from_payload(telemetry) if telemetry is not None else None,
        })

    def to_dict(self) -> dict[str, Any]:
        # From ``data`` itself, not through the properties: this runs at every step with stats.
        data = self.data
        calls, transfers, telemetry = data.get(CALLS_KEY), data.get(TRANSFERS_KEY), data.get(TELEMETRY_KEY)
        native = data.get(NATIVE_KEY)
        return {
            CALLS_KEY: calls.to_dict() if calls is not None else None,
            TRANSFERS_KEY: transfers.to_dict() if transfers is not None else None,
            NATIVE_KEY: {name: stats.to_dict() for name, stats in native.items()} if native else {},
            BREAKERS_KEY: data.get(BREAKERS_KEY) or {},
            TELEMETRY_KEY: telemetry.to_dict() if telemetry is not None else None,
        }

    def aggregate(self, other: KVConnectorStats) -> KVComposeStats:
        """Add ``other`` into this object (``other`` is not modified; a table or child's stats this object lacks is
        shared with it until this object is merged into again)."""
        if not isinstance(other, KVComposeStats):
            other = KVComposeStats.from_payload(other.data)
        for key, copy_of in ((CALLS_KEY, _copied_table), (TRANSFERS_KEY, _copied_table),
                             (TELEMETRY_KEY, TelemetryCounters.copy)):
            if (theirs := other.data.get(key)) is not None:
                self._add_into("data", self.data, key, theirs, copy_of)
        if other_native := other.data.get(NATIVE_KEY):
            for name, stats in other_native.items():
                self._add_into(NATIVE_KEY, self.native, name, stats, NativeStats.copy)
        for name, breaker in (other.data.get(BREAKERS_KEY) or {}).items():
            mine_breaker = self.breakers.get(name)
            # The worst state of any process (scheduler, workers) shows.
            self.breakers[name] = breaker if mine_breaker is None else {
                "state": max(mine_breaker["state"], breaker["state"]),
                "opens": mine_breaker["opens"] + breaker["opens"],
            }
        return self

    def _add_into(self, section: str, tables: dict[str, Any], key: str, theirs: _Addable,
                  copy_of: Callable[[Any], _Addable]) -> None:
        """Add ``theirs`` into ``tables[key]`` (``section`` names ``tables``): taken over as it is where there is
        none, copied first where it was taken over."""
        mine = tables.get(key)
        if mine is None:
            tables[key] = theirs
            self._borrowed.add((section, key))
            return
        if (section, key) in self._borrowed:
            self._borrowed.discard((section, key))
            mine = tables[key] = copy_of(mine)
        mine.add(theirs)

    def reset(self) -> None:
        self._borrowed.clear()
        self.calls = None
        self.transfers = None
        self.telemetry = None
        self.breakers.clear()
        for stats in self.native.values():
            stats.stats.reset()

    def reduce(self) -> dict[str, int | float]:
        """One line of numbers for vLLM's periodic log: calls and mean ms per child and op, transfers."""
        reduced = self.calls.reduce() if self.calls is not None else {}
        if self.transfers is not None:
            reduced.update(self.transfers.reduce())
        if self.telemetry is not None:
            reduced.update(self.telemetry.reduce())
        for name, stats in self.native.items():
            for key, value in stats.stats.reduce().items():
                reduced[f"{name}.{key}"] = value
        return reduced

    def is_empty(self) -> bool:
        data = self.data  # not through the properties: this runs at every step with stats
        calls, transfers, telemetry = data.get(CALLS_KEY), data.get(TRANSFERS_KEY), data.get(TELEMETRY_KEY)
        return (
            (calls is None or calls.is_empty())
            and (transfers is None or transfers.is_empty())
            and (telemetry is None or telemetry.is_empty())
            and not data.get(BREAKERS_KEY)
            and all(stats.stats.is_empty() for stats in (data.get(NATIVE_KEY) or {}).values())
        )
