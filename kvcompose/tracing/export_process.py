"""The exporter process: encodes span records as OpenTelemetry spans and exports them.

Started by :class:`kvcompose.tracing.shipping.ProcessShipper`, one per engine
process that traces, so that building and encoding spans (most of tracing's
cost) never runs on the engine's CPU. It reads the engine's :class:`Ring` (its
path is the one argument) and sleeps in between. A process wake-up costs about
0.1 ms of CPU on these machines, and the engine ships ten times a second while
it traces, so the exporter is not woken by every ship: while records keep
coming it reads the ring every :data:`READ_EVERY_S`, woken early only if the
ring is half full. Once a read finds nothing it sleeps until the engine ships
again: the engine writes a byte to this process's stdin after shipping records
if it finds this process asleep (the ring's ``sleeping`` counter), and closes
stdin when it shuts down (or the kernel does, when it dies); asleep, the
exporter checks only every :data:`CHECK_ENGINE_S` that its engine is still
there. The first frame holds the settings
(``service_name``, ``exporter``, ``endpoint``, ``version``), every later one
is ``("t", [span templates])`` or ``("r", [span records])`` (see
:mod:`kvcompose.tracing.records`). It writes the spans it dropped (queue full
or export failed) and those waiting for export into the ring's counters.

With the OTLP/HTTP exporter, records are encoded by :mod:`kvcompose.tracing.otlp`
and sent through the exporter's own client; with any other exporter (console,
or an OTLP exporter without that client) they become SDK spans first.

Spans wait in a bounded queue (:data:`MAX_QUEUED_SPANS`); an unreachable
collector makes it drop and count, never grow. When the engine closes the ring
(or dies), the queue is flushed for at most :data:`SHUTDOWN_FLUSH_S`.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvcompose.tracing.exporters import protobuf_transport, span_exporter
from kvcompose.tracing.records import resource_for, to_readable_spans
from kvcompose.tracing.ring import CLOSED, DROPPED, QUEUED, SLEEPING, Ring

MAX_QUEUED_SPANS = 4096
EXPORT_BATCH = 512
# A batch goes out once this many seconds passed or EXPORT_BATCH spans wait, whichever comes first (the SDK's
# batch processor waits 5 s). A request costs the exporter's client about 0.6 ms of CPU whatever its size,
# and on a machine of few cores that CPU is taken from the engine's neighbour.
EXPORT_INTERVAL_S = 2.0
# While records keep coming, the ring is read this often (spans then wait for a batch: EXPORT_INTERVAL_S).
READ_EVERY_S = 1.0
# Asleep with no news this long, the exporter checks that its engine (its parent) still runs: the engine's end
# of stdin may live on in a process the engine forked, so its death need not close it.
CHECK_ENGINE_S = 5.0
SHUTDOWN_FLUSH_S = 2.0
TEMPLATES_FRAME, RECORDS_FRAME = "t", "r"


class _Encoding(Protocol):
    """How this process turns records into what its exporter sends, and sends a batch of them."""

    def add_templates(self, templates: Sequence[Sequence[Any]]) -> None: ...

    def spans(self, records: Sequence[Sequence[Any]]) -> list[Any]: ...

    def export(self, spans: list[Any]) -> bool: ...


class _ProtobufEncoding:
    """Records to serialised OTLP spans, sent as one request per batch by the exporter's client."""

    def __init__(self, send: Callable[[bytes], bool], service_name: str, version: str) -> None:
        from kvcompose.tracing.otlp import OtlpEncoder  # protobuf: loaded in the exporter process only

        self._send = send
        self._encoder = OtlpEncoder(resource_for(service_name), version)
        self.add_templates = self._encoder.add_templates
        self.spans = self._encoder.spans

    def export(self, spans: list[bytes]) -> bool:
        return self._send(self._encoder.request(spans))


class _SdkEncoding:
    """Records to SDK ``ReadableSpan`` objects, for any ``SpanExporter``."""

    def __init__(self, exporter: SpanExporter, service_name: str, version: str) -> None:
        self._exporter = exporter
        self._resource = resource_for(service_name)
        self._version = version
        self._templates: list[Sequence[Any]] = []

    def add_templates(self, templates: Sequence[Sequence[Any]]) -> None:
        self._templates += templates

    def spans(self, records: Sequence[Sequence[Any]]) -> list[Any]:
        return to_readable_spans(records, self._templates, self._resource, self._version)

    def export(self, spans: list[Any]) -> bool:
        return self._exporter.export(spans) is SpanExportResult.SUCCESS


def _encoding_for(exporter: SpanExporter, service_name: str, version: str) -> _Encoding:
    if (send := protobuf_transport(exporter)) is not None:
        return _ProtobufEncoding(send, service_name, version)
    return _SdkEncoding(exporter, service_name, version)


class _Exporting:
    """The bounded queue and the thread that drains it into the exporter."""

    def __init__(self, exporter: SpanExporter, encoding: _Encoding) -> None:
        self._exporter = exporter
        self._encoding = encoding
        self._queue: deque[Any] = deque()
        self._lock = threading.Lock()
        self._spans_waiting = threading.Event()  # set while the queue holds spans
        self._batch_full = threading.Event()  # ... EXPORT_BATCH of them
        self._done = threading.Event()
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kvcompose-export", daemon=True)
        self._thread.start()

    def receive(self, frame: tuple[str, Sequence[Sequence[Any]]]) -> None:
        """A frame of templates or of records from the engine."""
        kind, items = frame
        if kind == TEMPLATES_FRAME:
            self._encoding.add_templates(items)
        else:
            spans = self._encoding.spans(items)
            self._add(spans, unreadable=len(items) - len(spans))

    def _add(self, spans: list[Any], unreadable: int) -> None:
        """Queue what fits; count the rest, and ``unreadable`` records, as dropped."""
        with self._lock:
            room = MAX_QUEUED_SPANS - len(self._queue)
            self._queue.extend(spans[:room])
            self.dropped += max(0, len(spans) - room) + unreadable
            if self._queue:
                self._spans_waiting.set()
            if len(self._queue) >= EXPORT_BATCH:
                self._batch_full.set()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def _take(self) -> list[Any]:
        with self._lock:
            batch = [self._queue.popleft() for _ in range(min(EXPORT_BATCH, len(self._queue)))]
            if not self._queue:
                self._spans_waiting.clear()
        return batch

    def _run(self) -> None:
        while not self._done.is_set():
            self._spans_waiting.wait()  # an empty queue sleeps until spans come
            self._batch_full.wait(EXPORT_INTERVAL_S)  # they gather for a batch
            self._batch_full.clear()
            while batch := self._take():
                self._export(batch)

    def _export(self, batch: list[Any]) -> None:
        try:
            ok = self._encoding.export(batch)
        except Exception:
            ok = False
        if not ok:
            with self._lock:
                self.dropped += len(batch)

    def close(self) -> None:
        self._done.set()
        self._spans_waiting.set()
        self._batch_full.set()
        self._thread.join(SHUTDOWN_FLUSH_S)
        deadline = time.monotonic() + SHUTDOWN_FLUSH_S
        while time.monotonic() < deadline and (batch := self._take()):
            self._export(batch)
        self._exporter.shutdown()


def _sleep(ring: Ring, records_came: bool) -> bool:
    """Sleep until the next read; True if the engine is gone (it closed its end of this process's stdin).
    After a read that found records (``records_came``): for :data:`READ_EVERY_S`, or until the engine finds the
    ring half full. Else until the engine ships records, or :data:`CHECK_ENGINE_S` pass."""
    if records_came:
        return _engine_gone_after(READ_EVERY_S)
    ring.set_counter(SLEEPING, 1)
    try:
        if ring.unread():  # shipped after the last take, maybe before the engine could see this process asleep
            return False
        return _engine_gone_after(CHECK_ENGINE_S)
    finally:
        ring.set_counter(SLEEPING, 0)


def _engine_gone_after(timeout_s: float) -> bool:
    """Wait on stdin for at most ``timeout_s``: wake-up bytes (False), or end of file (True: the engine is gone)."""
    readable, _, _ = select.select([sys.stdin], [], [], timeout_s)
    return bool(readable) and not os.read(sys.stdin.fileno(), 4096)


def main() -> None:
    ring = Ring.attach(sys.argv[1])
    with contextlib.suppress(OSError):  # both sides have it mapped: no file is left if the engine dies
        os.unlink(sys.argv[1])
    engine = os.getppid()
    settings: dict[str, Any] | None = None
    exporting: _Exporting | None = None
    engine_gone = False
    while True:
        closing = engine_gone or ring.counter(CLOSED) or os.getppid() != engine
        frames = ring.take()
        for frame in frames:
            if settings is None:
                settings = frame
                exporter = span_exporter(settings["exporter"], settings["endpoint"])
                if exporter is None:
                    return
                exporting = _Exporting(exporter, _encoding_for(exporter, settings["service_name"], settings["version"]))
            else:
                assert exporting is not None  # made from the first frame
                exporting.receive(frame)
        if exporting is not None:
            ring.set_counter(DROPPED, exporting.dropped)
            ring.set_counter(QUEUED, exporting.queued)
        if closing:
            break
        engine_gone = _sleep(ring, records_came=bool(frames))
    if exporting is not None:
        exporting.close()


if __name__ == "__main__":
    main()
