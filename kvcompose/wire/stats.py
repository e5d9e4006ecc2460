"""KVComposeStats: the composite's mergeable stats, keyed by child name.

``data`` holds kvcompose's own reports (each a :class:`Report` section: the
:class:`CallTable` of every child's calls, the :class:`TransferTable` of every
child's transfers, the span exporter's :class:`TelemetryCounters`, the tier
:class:`EconomicsReport`), each child's native stats, and its circuit
breaker's report. It crosses processes as plain data (``to_dict``)::

    {"calls": <CallTable.to_dict()> | None,
     "transfers": <TransferTable.to_dict()> | None,
     "telemetry": {"dropped": {reason: count}, "spans_queued": count | None, "exporter_restarts": count} | None,
     "economics": <EconomicsReport.to_dict()> | None,
     "routing": <RoutingReport.to_dict()> | None,
     "tenants": <TenantReport.to_dict()> | None,
     "native": {child: {"class": "module:Class", "stats": <the child's own stats dict>}},
     "breakers": {child: {"state": 0 closed | 1 open | 2 half-open, "opens": count}}}

Its size is bounded by children x (operations + directions) x buckets, and by (top K + 3) tenant labels x
(children + curve sizes), whatever the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvcompose.wire.calls import CallTable
from kvcompose.wire.economics import EconomicsReport
from kvcompose.wire.native import NativeStats
from kvcompose.wire.routing import RoutingReport
from kvcompose.wire.telemetry import TelemetryCounters
from kvcompose.wire.tenants import TenantReport
from kvcompose.wire.transfers import TransferTable

CALLS_KEY = "calls"
NATIVE_KEY = "native"
BREAKERS_KEY = "breakers"
TRANSFERS_KEY = "transfers"
TELEMETRY_KEY = "telemetry"
ECONOMICS_KEY = "economics"
ROUTING_KEY = "routing"
TENANTS_KEY = "tenants"


class Report(Protocol):
    """A section of kvcompose's own stats: merged with ``add``, carried as a plain dict."""

    def add(self, other: Any) -> None: ...

    def copy(self) -> Any: ...

    def is_empty(self) -> bool: ...

    def reduce(self) -> dict[str, int | float]: ...

    def to_dict(self) -> dict[str, Any]: ...


# Each report section's key and class (its ``from_payload`` rebuilds it after a process hop).
SECTIONS: dict[str, Any] = {CALLS_KEY: CallTable, TRANSFERS_KEY: TransferTable, TELEMETRY_KEY: TelemetryCounters,
                            ECONOMICS_KEY: EconomicsReport, ROUTING_KEY: RoutingReport, TENANTS_KEY: TenantReport}


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
    def economics(self) -> EconomicsReport | None:
        return self.data.get(ECONOMICS_KEY)

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
        data: dict[str, Any] = {key: section.from_payload(report) if (report := payload.get(key)) is not None
                                else None for key, section in SECTIONS.items()}
        return cls(data={**data, NATIVE_KEY: native, BREAKERS_KEY: dict(payload.get(BREAKERS_KEY, {}))})

    def to_dict(self) -> dict[str, Any]:
        data = self.data
        native = data.get(NATIVE_KEY)
        return {
            **{key: report.to_dict() if (report := data.get(key)) is not None else None for key in SECTIONS},
            NATIVE_KEY: {name: stats.to_dict() for name, stats in native.items()} if native else {},
            BREAKERS_KEY: data.get(BREAKERS_KEY) or {},
        }

    def aggregate(self, other: KVConnectorStats) -> KVComposeStats:
        """Add ``other`` into this object (``other`` is not modified; a report or child's stats this object lacks
        is shared with it until this object is merged into again)."""
        if not isinstance(other, KVComposeStats):
            other = KVComposeStats.from_payload(other.data)
        for key in SECTIONS:
            if (theirs := other.data.get(key)) is not None:
                self._add_into("data", self.data, key, theirs)
        if other_native := other.data.get(NATIVE_KEY):
            for name, stats in other_native.items():
                self._add_into(NATIVE_KEY, self.native, name, stats)
        for name, breaker in (other.data.get(BREAKERS_KEY) or {}).items():
            mine_breaker = self.breakers.get(name)
            # The worst state of any process (scheduler, workers) shows.
            self.breakers[name] = breaker if mine_breaker is None else {
                "state": max(mine_breaker["state"], breaker["state"]),
                "opens": mine_breaker["opens"] + breaker["opens"],
            }
        return self

    def _add_into(self, section: str, reports: dict[str, Any], key: str, theirs: Report | NativeStats) -> None:
        """Add ``theirs`` into ``reports[key]`` (``section`` names ``reports``): taken over as it is where there is
        none, copied first where it was taken over."""
        mine = reports.get(key)
        if mine is None:
            reports[key] = theirs
            self._borrowed.add((section, key))
            return
        if (section, key) in self._borrowed:
            self._borrowed.discard((section, key))
            mine = reports[key] = mine.copy()
        mine.add(theirs)

    def reset(self) -> None:
        self._borrowed.clear()
        for key in SECTIONS:
            self.data[key] = None
        self.breakers.clear()
        for stats in self.native.values():
            stats.stats.reset()

    def reduce(self) -> dict[str, int | float]:
        """One line of numbers for vLLM's periodic log: calls and mean ms per child and op, transfers, ..."""
        reduced: dict[str, int | float] = {}
        for key in SECTIONS:
            if (report := self.data.get(key)) is not None:
                reduced.update(report.reduce())
        for name, stats in self.native.items():
            for key, value in stats.stats.reduce().items():
                reduced[f"{name}.{key}"] = value
        return reduced

    def is_empty(self) -> bool:
        data = self.data
        return (all(report is None or report.is_empty() for report in map(data.get, SECTIONS))
                and not data.get(BREAKERS_KEY)
                and all(stats.stats.is_empty() for stats in (data.get(NATIVE_KEY) or {}).values()))
