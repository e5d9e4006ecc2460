"""The exporter process: turns span records into OpenTelemetry spans and exports them.

Started by :class:`kvcompose.tracing.shipping.ProcessShipper`, one per engine
process that traces, so that building and encoding spans (most of tracing's
cost) never runs on the engine's CPU. Its arguments: the engine's process id,
the file descriptor of the engine's :class:`Ring`, and that of a pipe the
engine watches (its end closes when this process ends, however it ends).

Outside the engine's process tree: on SIGTERM, ``vllm serve`` SIGKILLs every
descendant of its engine processes at once (``--shutdown-timeout`` 0, the
default, gives them no time), and the spans the engine shipped last would die
with an exporter among them. So the engine starts it through a launcher that
forks it and exits at once (:mod:`kvcompose.tracing.shipping`): the exporter
lives on outside the tree, notices the engine's end (see
:class:`_EngineWatch`), reads what is left in the ring, exports it within the
flush time the engine sent (``flush_s``) and exits. What is still queued then
is counted (the ring's ``shutdown`` counter) and logged. An engine killed
before its ``atexit`` leaves its live files (:mod:`kvcompose.live`): the
exporter removes them.

Schedule: every wake-up costs the exporter CPU, and the engine ships ten
times a second while it traces, so the exporter is not woken by every ship:
while records keep coming it reads the ring every :data:`READ_EVERY_S`,
woken early only if the ring is half full. Once a read
finds nothing it sleeps until the engine ships again: the engine writes a byte
to this process's stdin after shipping records if it finds this process asleep
(the ring's ``sleeping`` counter). The first frame holds the settings
(``service_name``, ``exporter``, ``endpoint``, ``version``, ``flush_s``,
``log_format``, ``log_level``); every later one is ``("t", [span templates])``
or ``("r", [span records])`` (see :mod:`kvcompose.tracing.records`).

Spans become SDK ``ReadableSpan`` objects and go out through the exporter's
public ``SpanExporter.export``; for OTLP/HTTP that exporter brings the
endpoint, headers, TLS, compression, retries and the ``OTEL_EXPORTER_OTLP_*``
settings. They wait in a bounded queue (:data:`MAX_QUEUED_SPANS`): an
unreachable collector makes it drop and count, never grow. Every span ends in
one of the ring's accounts (exported, or dropped by reason), written as it
happens, so the engine knows at any time how many wait and, if this process
dies, how many died with it.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcompose.live import process_alive, remove_files_of
from kvcompose.tracing.ring import (
    CLOSED,
    EXPORT_FAILED,
    EXPORTED,
    PID,
    QUEUE_FULL,
    SHUTDOWN_LOST,
    SLEEPING,
    UNREADABLE,
    Ring,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

MAX_QUEUED_SPANS = 4096
EXPORT_BATCH = 512
# A batch goes out once this many seconds passed or EXPORT_BATCH spans wait, whichever comes first (the SDK's
# batch processor waits 5 s): an export request costs the exporter's client CPU whatever its size, and on a
# machine of few cores that CPU is taken from the engine's neighbour.
EXPORT_INTERVAL_S = 2.0
# While records keep coming, the ring is read this often (spans then wait for a batch: EXPORT_INTERVAL_S).
READ_EVERY_S = 1.0
# Asleep with no news this long, the exporter checks that its engine still runs (where the kernel cannot tell it
# at once: no pidfd).
CHECK_ENGINE_S = 5.0
# Once done, the exporter waits this long for its engine to end (vLLM kills an engine process it asked to stop
# after 5 s by default), to remove the live files an engine killed before its atexit leaves.
ENGINE_END_WAIT_S = 5.0
TEMPLATES_FRAME, RECORDS_FRAME = "t", "r"


class _Exporting:
    """The bounded queue of spans, the thread that drains it into the exporter, and the ring's span accounts."""

    def __init__(self, exporter: SpanExporter, ring: Ring, service_name: str, version: str) -> None:
        from kvcompose.tracing.records import resource_for

        self._exporter = exporter
        self._ring = ring
        self._resource = resource_for(service_name)
        self._version = version
        self._templates: list[Sequence[Any]] = []
        self._queue: deque[Any] = deque()
        self._lock = threading.Lock()
        self._spans_waiting = threading.Event()  # set while the queue holds spans
        self._batch_full = threading.Event()  # ... EXPORT_BATCH of them, or flushing
        self._flushing = threading.Event()
        # Each account is written by one thread: queue_full and unreadable by the reading (main) thread,
        # exported and export_failed by the exporting one.
        self._queue_full = self._unreadable = self._exported = self._failed = 0
        self._in_flight = 0  # spans of the export running now
        self._flushed = False  # flush() is over: what is left is counted lost
        self._thread = threading.Thread(target=self._run, name="kvcompose-export", daemon=True)
        self._thread.start()

    def receive(self, frame: tuple[str, Sequence[Sequence[Any]]]) -> None:
        """A frame of templates or of records from the engine."""
        from kvcompose.tracing.records import to_readable_spans

        kind, items = frame
        if kind == TEMPLATES_FRAME:
            self._templates += items
            return
        spans = to_readable_spans(items, self._templates, self._resource, self._version)
        with self._lock:
            room = MAX_QUEUED_SPANS - len(self._queue)
            self._queue.extend(spans[:room])
            if self._queue:
                self._spans_waiting.set()
            if len(self._queue) >= EXPORT_BATCH:
                self._batch_full.set()
        self._queue_full += max(0, len(spans) - room)
        self._unreadable += len(items) - len(spans)
        self._ring.set_counter(QUEUE_FULL, self._queue_full)
        self._ring.set_counter(UNREADABLE, self._unreadable)

    def _take(self) -> list[Any]:
        with self._lock:
            batch = [self._queue.popleft() for _ in range(min(EXPORT_BATCH, len(self._queue)))]
            self._in_flight = len(batch)
            if not self._queue:
                self._spans_waiting.clear()
        return batch

    def _run(self) -> None:
        while True:
            self._spans_waiting.wait()  # an empty queue sleeps until spans come
            self._batch_full.wait(EXPORT_INTERVAL_S)  # they gather for a batch
            self._batch_full.clear()
            while batch := self._take():
                self._export(batch)
            if self._flushing.is_set():
                return

    def _export(self, batch: list[Any]) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            ok = self._exporter.export(batch) is SpanExportResult.SUCCESS
        except Exception:
            ok = False
        with self._lock:
            if self._flushed:  # too late: flush() counted this batch as lost at shutdown
                return
            self._in_flight = 0
            if ok:
                self._exported += len(batch)
                self._ring.set_counter(EXPORTED, self._exported)
            else:
                self._failed += len(batch)
                self._ring.set_counter(EXPORT_FAILED, self._failed)

    def flush(self, seconds: float) -> int:
        """Export what is queued for at most ``seconds``; the spans left (counted as lost at shutdown)."""
        self._flushing.set()
        self._spans_waiting.set()
        self._batch_full.set()
        self._thread.join(seconds)
        with self._lock:
            self._flushed = True
            lost = len(self._queue) + self._in_flight
        self._ring.set_counter(SHUTDOWN_LOST, lost)
        return lost


class _EngineWatch:
    """Tells when the engine is done with this process: it set the ring's ``closed`` counter, closed this
    process's stdin (or the kernel did, when it died), or died (seen at once through a pidfd where Linux
    has them); or SIGTERM asks this process itself to stop."""

    def __init__(self, engine_pid: int) -> None:
        self._engine_pid = engine_pid
        self._engine_fd: int | None = None  # None: the engine's life is polled
        self.gone = not process_alive(engine_pid)
        if hasattr(os, "pidfd_open") and not self.gone:
            try:
                self._engine_fd = os.pidfd_open(engine_pid)
            except ProcessLookupError:
                self.gone = True
            except OSError:  # a kernel without pidfds
                pass
        self._signals, wakeup = os.pipe()
        os.set_blocking(wakeup, False)
        signal.set_wakeup_fd(wakeup)
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the wake-up fd reports it

    def wait(self, timeout_s: float) -> None:
        """Sleep until the engine ships (a byte on stdin), goes, or ``timeout_s`` pass."""
        stdin = sys.stdin.fileno()
        watched = [stdin, self._signals] + ([self._engine_fd] if self._engine_fd is not None else [])
        readable, _, _ = select.select(watched, [], [], timeout_s)
        if self._engine_fd in readable or self._signals in readable or (
                stdin in readable and not os.read(stdin, 4096)) or (
                self._engine_fd is None and not process_alive(self._engine_pid)):
            self.gone = True

    def engine_died(self, within_s: float) -> bool:
        """Whether the engine process has ended, or ends within ``within_s`` (the kernel closes a killed
        process's files, its stdin pipe among them, a moment before it counts it as ended)."""
        if self._engine_fd is None:
            return not process_alive(self._engine_pid)
        readable, _, _ = select.select([self._engine_fd], [], [], within_s)
        return bool(readable)


def _sleep(ring: Ring, watch: _EngineWatch, records_came: bool) -> None:
    """Sleep until the next read. After a read that found records (``records_came``): for
    :data:`READ_EVERY_S`, or until the engine finds the ring half full. Else until the engine ships records,
    or :data:`CHECK_ENGINE_S` pass."""
    if records_came:
        watch.wait(READ_EVERY_S)
        return
    ring.set_counter(SLEEPING, 1)
    try:
        if not ring.unread():  # else shipped after the last take, maybe before the engine could see it asleep
            watch.wait(CHECK_ENGINE_S)
    finally:
        ring.set_counter(SLEEPING, 0)


def _log_lost(settings: dict[str, Any], lost: int, flush_s: float) -> None:
    from kvcompose.config import LoggingSection
    from kvcompose.logs import configure_logging, get_logger

    configure_logging(LoggingSection(format=settings["log_format"], level=settings["log_level"]))
    get_logger("tracing").warning("spans_lost_at_shutdown", spans=lost, flush_s=flush_s,
                                  service_name=settings["service_name"])


def main() -> None:
    engine_pid, ring_fd = int(sys.argv[1]), int(sys.argv[2])  # argv[3]: the pipe end held for the engine to watch
    ring = Ring.attach(ring_fd)
    ring.set_counter(PID, os.getpid())
    watch = _EngineWatch(engine_pid)
    settings: dict[str, Any] | None = None
    exporting: _Exporting | None = None
    while True:
        closing = watch.gone or ring.counter(CLOSED)  # before the take: it then gets the last frames
        frames = ring.take()
        for frame in frames:
            if settings is None:
                from kvcompose.tracing.exporters import span_exporter

                settings = frame
                exporter = span_exporter(settings["exporter"], settings["endpoint"])
                exporting = _Exporting(exporter, ring, settings["service_name"], settings["version"])
            else:
                assert exporting is not None  # made from the first frame
                exporting.receive(frame)
        if closing:
            break
        _sleep(ring, watch, records_came=bool(frames))
    if exporting is not None and settings is not None:
        if lost := exporting.flush(settings["flush_s"]):
            _log_lost(settings, lost, settings["flush_s"])
    if watch.engine_died(within_s=ENGINE_END_WAIT_S):  # maybe killed before its atexit ran
        remove_files_of(engine_pid)
    sys.stderr.flush()
    os._exit(0)  # an export still running (a collector that does not answer) must not hold the process


if __name__ == "__main__":
    main()
