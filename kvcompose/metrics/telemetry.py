"""TelemetryCounters: how kvcompose's own span export is keeping up, carried with the stats.

Each process (scheduler, every worker) exports its spans from a bounded queue
and drops spans once it is full. A report holds the spans dropped since the
last report and the spans waiting in the queue now (``None``: not reported,
so an unchanged queue costs nothing on the wire).

Merging adds the drops and keeps the largest queue: a process drops once its
own queue is full, so the fullest one tells how near the engine is to
dropping; and vLLM also merges successive steps' stats for its log line,
where a sum of queue lengths would count the same waiting spans again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TelemetryCounters:
    spans_dropped: int = 0
    spans_queued: int | None = None

    def add(self, other: TelemetryCounters) -> None:
        """Add ``other``'s report into this one (``other`` is not modified)."""
        self.spans_dropped += other.spans_dropped
        if other.spans_queued is not None:
            self.spans_queued = max(other.spans_queued, self.spans_queued or 0)

    def is_empty(self) -> bool:
        return not self.spans_dropped and self.spans_queued is None

    def copy(self) -> TelemetryCounters:
        return TelemetryCounters(self.spans_dropped, self.spans_queued)

    def reduce(self) -> dict[str, int]:
        reduced = {"spans_dropped": self.spans_dropped} if self.spans_dropped else {}
        if self.spans_queued is not None:
            reduced["spans_queued"] = self.spans_queued
        return reduced

    def to_dict(self) -> dict[str, Any]:
        return {"spans_dropped": self.spans_dropped, "spans_queued": self.spans_queued}

    @classmethod
    def from_payload(cls, payload: TelemetryCounters | dict[str, Any]) -> TelemetryCounters:
        if isinstance(payload, TelemetryCounters):
            return payload
        return cls(payload["spans_dropped"], payload["spans_queued"])
