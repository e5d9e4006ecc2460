"""The exporter process: turns span records into OpenTelemetry spans and exports them.

Started by :class:`kvcompose.tracing.shipping.ProcessShipper`, one per engine
process that traces, so that building and encoding spans (most of tracing's
cost) never runs on the engine's CPU. It polls the engine's :class:`Ring`
(its path is the one argument): the first frame holds the settings
(``service_name``, ``exporter``, ``endpoint``, ``version``), every later one
is ``("t", [span templates])`` or ``("r", [span records])`` (see
:mod:`kvcompose.tracing.records`). It writes the spans it dropped (queue full
or export failed) and those waiting for export into the ring's counters.

Spans wait in a bounded queue (:data:`MAX_QUEUED_SPANS`); an unreachable
collector makes it drop and count, never grow. When the engine closes the ring
(or dies), the queue is flushed for at most :data:`SHUTDOWN_FLUSH_S`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import deque
from typing import Any

from kvcompose.tracing.ring import CLOSED, DROPPED, QUEUED, Ring

MAX_QUEUED_SPANS = 4096
EXPORT_BATCH = 512
EXPORT_INTERVAL_S = 0.5
POLL_S = 0.1
SHUTDOWN_FLUSH_S = 2.0
TEMPLATES_FRAME, RECORDS_FRAME = "t", "r"


class _Exporting:
    """The bounded queue and the thread that drains it into the exporter."""

    def __init__(self, exporter: Any) -> None:
        self._exporter = exporter
        self._queue: deque[Any] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._done = threading.Event()
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kvcompose-export", daemon=True)
        self._thread.start()

    def add(self, spans: list[Any], unreadable: int = 0) -> None:
        """Queue what fits; count the rest, and ``unreadable`` records, as dropped."""
        with self._lock:
            room = MAX_QUEUED_SPANS - len(self._queue)
            self._queue.extend(spans[:room])
            self.dropped += max(0, len(spans) - room) + unreadable
            if len(self._queue) >= EXPORT_BATCH:
                self._wake.set()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def _take(self) -> list[Any]:
        with self._lock:
            batch = [self._queue.popleft() for _ in range(min(EXPORT_BATCH, len(self._queue)))]
        return batch

    def _run(self) -> None:
        while not self._done.is_set():
            self._wake.wait(EXPORT_INTERVAL_S)
            self._wake.clear()
            while batch := self._take():
                self._export(batch)

    def _export(self, batch: list[Any]) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            ok = self._exporter.export(batch) is SpanExportResult.SUCCESS
        except Exception:
            ok = False
        if not ok:
            with self._lock:
                self.dropped += len(batch)

    def close(self) -> None:
        self._done.set()
        self._wake.set()
        self._thread.join(SHUTDOWN_FLUSH_S)
        deadline = time.monotonic() + SHUTDOWN_FLUSH_S
        while time.monotonic() < deadline and (batch := self._take()):
            self._export(batch)
        self._exporter.shutdown()


def main() -> None:
    from kvcompose.tracing.exporters import span_exporter
    from kvcompose.tracing.records import resource_for, to_readable_spans

    ring = Ring.attach(sys.argv[1])
    with contextlib.suppress(OSError):  # both sides have it mapped: no file is left if the engine dies
        os.unlink(sys.argv[1])
    engine = os.getppid()
    settings: dict[str, Any] | None = None
    exporting: _Exporting | None = None
    templates: list[Any] = []
    while True:
        closing = ring.counter(CLOSED) or os.getppid() != engine
        for frame in ring.take():
            if settings is None:
                settings = frame
                exporter = span_exporter(settings["exporter"], settings["endpoint"])
                if exporter is None:
                    return
                resource = resource_for(settings["service_name"])
                exporting = _Exporting(exporter)
            elif frame[0] == TEMPLATES_FRAME:
                templates += frame[1]
            elif exporting is not None:
                spans = to_readable_spans(frame[1], templates, resource, settings["version"])
                exporting.add(spans, unreadable=len(frame[1]) - len(spans))
        if exporting is not None:
            ring.set_counter(DROPPED, exporting.dropped)
            ring.set_counter(QUEUED, exporting.queued)
        if closing:
            break
        time.sleep(POLL_S)
    if exporting is not None:
        exporting.close()


if __name__ == "__main__":
    main()
