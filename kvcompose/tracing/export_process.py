"""The exporter process: turns span records into OpenTelemetry spans and exports them.

Started by :class:`kvcompose.tracing.shipping.ProcessShipper`, one per engine
process that traces, so that building and encoding spans (most of tracing's
cost) never runs on the engine's CPU. Protocol:

- stdin: frames of a 4-byte big-endian length and a ``marshal`` payload. The
  first frame is the settings (``{"service_name", "exporter", "endpoint",
  "version"}``), every later one a list of :class:`SpanRecord` tuples.
- stdout: one line ``"<dropped> <queued>\\n"`` a second: spans dropped so far
  (queue full or export failed) and spans waiting for export.

Spans wait in a bounded queue (:data:`MAX_QUEUED_SPANS`); an unreachable
collector makes it drop and count, never grow. At end of input the queue is
flushed for at most :data:`SHUTDOWN_FLUSH_S`.
"""

from __future__ import annotations

import marshal
import struct
import sys
import threading
import time
from collections import deque
from typing import Any, BinaryIO

MAX_QUEUED_SPANS = 4096
EXPORT_BATCH = 512
EXPORT_INTERVAL_S = 0.5
SHUTDOWN_FLUSH_S = 2.0
FRAME_HEADER = struct.Struct(">I")


def read_frame(stream: BinaryIO) -> Any | None:
    """The next frame's value, or None at end of input."""
    header = stream.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    payload = stream.read(size)
    return marshal.loads(payload) if len(payload) == size else None


def encode_frame(value: Any) -> bytes:
    payload = marshal.dumps(value)
    return FRAME_HEADER.pack(len(payload)) + payload


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

    def add(self, spans: list[Any]) -> None:
        with self._lock:
            room = MAX_QUEUED_SPANS - len(self._queue)
            self._queue.extend(spans[:room])
            self.dropped += max(0, len(spans) - room)
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


def _report(exporting: _Exporting, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            sys.stdout.write(f"{exporting.dropped} {exporting.queued}\n")
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            return


def main() -> None:
    from kvcompose.tracing.exporters import span_exporter
    from kvcompose.tracing.records import resource_for, to_readable_spans

    stdin = sys.stdin.buffer
    settings = read_frame(stdin)
    if settings is None:
        return
    exporter = span_exporter(settings["exporter"], settings["endpoint"])
    if exporter is None:
        return
    resource = resource_for(settings["service_name"])
    exporting = _Exporting(exporter)
    stop = threading.Event()
    threading.Thread(target=_report, args=(exporting, stop), daemon=True).start()
    while (records := read_frame(stdin)) is not None:
        exporting.add(to_readable_spans(records, resource, settings["version"]))
    stop.set()
    exporting.close()


if __name__ == "__main__":
    main()
