"""TelemetryCounters: how kvcompose's own span export is keeping up, carried with the stats.

Each engine process (scheduler, every worker) ships its spans to an exporter
process of its own. A report holds, since the last report of that process:

- ``dropped``: spans lost, by reason (:data:`DROP_REASONS`):
  ``queue_full`` (the hand-over pipe or the exporter's queue was full: a slow or
  unreachable collector), ``export_failed`` (the collector refused them, or
  the exporter could not read them), ``exporter_down`` (the exporter process
  died with them, or they did not fit while a new one was starting),
  ``shutdown`` (still waiting when the flush time at shutdown ran out);
- ``exporter_restarts``: exporter processes started again after one died;
- ``spans_queued``: spans waiting for export now (``None``: not reported, so an
  unchanged queue costs nothing on the wire).

Merging (``add``: vLLM merges the workers' reports of a step, and successive
steps' stats for its log line) adds the drops, reason by reason, and the
restarts, and keeps the largest queue: a process drops once its own queue is
full, so the fullest one tells how near the engine is to dropping, and a sum
over successive steps would count the same waiting spans again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DROP_REASONS = ("queue_full", "export_failed", "exporter_down", "shutdown")
# The keys under which an engine process publishes on its live board (kvcompose.live): its spans waiting for
# export, and (one key per role, as a list of [child, op, seconds, stuck]) the calls into children the watchdog
# sees running long.
LIVE_SPANS_QUEUED = "spans_queued"
LIVE_RUNNING_CALLS = "running_calls"


@dataclass
class TelemetryCounters:
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> spans; reasons with none are left out
    spans_queued: int | None = None
    exporter_restarts: int = 0

    def add(self, other: TelemetryCounters) -> None:
        """Add ``other``'s report into this one (``other`` is not modified)."""
        for reason, spans in other.dropped.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + spans
        self.exporter_restarts += other.exporter_restarts
        if other.spans_queued is not None:
            self.spans_queued = max(other.spans_queued, self.spans_queued or 0)

    @property
    def spans_dropped(self) -> int:
        return sum(self.dropped.values())

    def is_empty(self) -> bool:
        return not self.dropped and not self.exporter_restarts and self.spans_queued is None

    def copy(self) -> TelemetryCounters:
        return TelemetryCounters(dict(self.dropped), self.spans_queued, self.exporter_restarts)

    def reduce(self) -> dict[str, int]:
        """For vLLM's log line: the totals that are not zero, and the queue when reported."""
        reduced = {"spans_dropped": self.spans_dropped, "exporter_restarts": self.exporter_restarts}
        reduced = {name: value for name, value in reduced.items() if value}
        if self.spans_queued is not None:
            reduced["spans_queued"] = self.spans_queued
        return reduced

    def to_dict(self) -> dict[str, Any]:
        return {"dropped": dict(self.dropped), "spans_queued": self.spans_queued,
                "exporter_restarts": self.exporter_restarts}

    @classmethod
    def from_payload(cls, payload: TelemetryCounters | dict[str, Any]) -> TelemetryCounters:
        if isinstance(payload, TelemetryCounters):
            return payload
        return cls(dict(payload["dropped"]), payload["spans_queued"], payload["exporter_restarts"])
