"""The exporter process: turns span records into OpenTelemetry spans and exports them.

Started by :class:`kvcompose.tracing.shipping.ProcessShipper`, one per engine
process that traces, so that building and encoding spans (most of tracing's
cost) never runs on the engine's CPU. Its arguments: the engine's process id
and the file descriptors of the pipes from and to the engine
(:mod:`kvcompose.tracing.handover`).

Outside the engine's process tree: on SIGTERM, ``vllm serve`` SIGKILLs every
descendant of its engine processes at once (``--shutdown-timeout`` 0, the
default, gives them no time), and the spans the engine shipped last would die
with an exporter among them. So the engine starts it through a launcher that
forks it and exits at once (:mod:`kvcompose.tracing.handover`): the exporter
lives on outside the tree, notices the engine's end (see
:class:`_EngineWatch`), reads what is left in the pipe, exports it within the
flush time the engine sent (``flush_s``) and exits. What is still queued then
is counted (its ``shutdown`` account) and logged. An engine killed
before its ``atexit`` leaves its live files (:mod:`kvcompose.live`): the
exporter removes them.

Schedule: every wake-up costs the exporter CPU, and the engine ships ten
times a second while it traces, so the exporter is not woken by every ship:
while records keep coming it reads the data pipe every :data:`READ_EVERY_S`,
woken early only by the engine finding the pipe half full. Once a read finds
nothing it waits on the data pipe itself, until the engine ships again. The
first frame holds the settings (``service_name``, ``exporter``, ``endpoint``,
``version``, ``flush_s``, ``log_format``, ``log_level``).

Spans become SDK ``ReadableSpan`` objects and go out through the exporter's
public ``SpanExporter.export``; for OTLP/HTTP that exporter brings the
endpoint, headers, TLS, compression, retries and the ``OTEL_EXPORTER_OTLP_*``
settings. They wait in a bounded queue (:data:`MAX_QUEUED_SPANS`): an
unreachable collector makes it drop and count, never grow. Every span ends in
one of its accounts (exported, or dropped by reason), sent to the engine as
they change, so the engine knows at any time how many wait and, if this
process dies, how many died with it.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvcompose.live import process_alive, remove_files_of
from kvcompose.tracing.handover import TEMPLATES_FRAME, Accounts, EngineLink

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

MAX_QUEUED_SPANS = 4096
EXPORT_BATCH = 512
# A batch goes out once this many seconds passed or EXPORT_BATCH spans wait, whichever comes first (the SDK's
# batch processor waits 5 s): an export request costs the exporter's client CPU whatever its size, and on a
# machine of few cores that CPU is taken from the engine's neighbour.
EXPORT_INTERVAL_S = 2.0
# While records keep coming, the data pipe is read this often (spans then wait for a batch: EXPORT_INTERVAL_S).
READ_EVERY_S = 1.0
# Asleep with no news this long, the exporter checks that its engine still runs (where the kernel cannot tell it
# at once: no pidfd).
CHECK_ENGINE_S = 5.0
# Once done, the exporter waits this long for its engine to end (vLLM kills an engine process it asked to stop
# after 5 s by default), to remove the live files an engine killed before its atexit leaves.
ENGINE_END_WAIT_S = 5.0


class _Exporting:
    """The bounded queue of spans, the thread that drains it into the exporter, and the span accounts, sent to
    ``report`` whole as they change."""

    def __init__(self, exporter: SpanExporter, report: Callable[[Accounts], None], service_name: str,
                 version: str) -> None:
        from kvcompose.tracing.records import resource_for

        self._exporter = exporter
        self._report = report
        self._resource = resource_for(service_name)
        self._version = version
        self._templates: list[Sequence[Any]] = []
        self._queue: deque[Any] = deque()
        self._lock = threading.Lock()
        self._spans_waiting = threading.Event()  # set while the queue holds spans
        self._batch_full = threading.Event()  # ... EXPORT_BATCH of them, or flushing
        self._flushing = threading.Event()
        self._accounts = Accounts()  # replaced under the lock: the reading (main) and exporting threads report
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
            if len(spans) > room or len(spans) < len(items):  # else no account changed: no report
                accounts = self._accounts
                self._settle(queue_full=accounts.queue_full + max(0, len(spans) - room),
                             unreadable=accounts.unreadable + len(items) - len(spans))

    def _settle(self, **accounts: int) -> None:
        """Change accounts and report them (under the lock: reports go out in the order of their changes)."""
        self._accounts = self._accounts._replace(**accounts)
        self._report(self._accounts)

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
                self._settle(exported=self._accounts.exported + len(batch))
            else:
                self._settle(export_failed=self._accounts.export_failed + len(batch))

    def flush(self, seconds: float) -> int:
        """Export what is queued for at most ``seconds``; the spans left (counted as lost at shutdown)."""
        self._flushing.set()
        self._spans_waiting.set()
        self._batch_full.set()
        self._thread.join(seconds)
        with self._lock:
            self._flushed = True
            lost = len(self._queue) + self._in_flight
            self._settle(shutdown=lost)
        return lost


class _EngineWatch:
    """Tells when the engine is done with this process: it said so or closed its pipes (or the kernel did,
    when it died), or died (seen at once through a pidfd where Linux has them); or SIGTERM asks this process
    itself to stop."""

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

    def wait(self, link: EngineLink, idle: bool, timeout_s: float) -> None:
        """Sleep until the engine wakes this process (``idle``: ships), goes, or ``timeout_s`` pass."""
        watched = [*link.waited_on(idle), self._signals] + ([self._engine_fd] if self._engine_fd is not None else [])
        readable, _, _ = select.select(watched, [], [], timeout_s)
        link.woken(readable)
        if self._engine_fd in readable or self._signals in readable or (
                self._engine_fd is None and not process_alive(self._engine_pid)):
            self.gone = True

    def engine_died(self, within_s: float) -> bool:
        """Whether the engine process has ended, or ends within ``within_s`` (the kernel closes a killed
        process's files, its pipes among them, a moment before it counts it as ended)."""
        if self._engine_fd is None:
            return not process_alive(self._engine_pid)
        readable, _, _ = select.select([self._engine_fd], [], [], within_s)
        return bool(readable)


def _log_lost(settings: dict[str, Any], lost: int, flush_s: float) -> None:
    from kvcompose.config import LoggingSection
    from kvcompose.logs import configure_logging, get_logger

    configure_logging(LoggingSection(format=settings["log_format"], level=settings["log_level"]))
    get_logger("tracing").warning("spans_lost_at_shutdown", spans=lost, flush_s=flush_s,
                                  service_name=settings["service_name"])


def main() -> None:
    engine_pid, data_fd, wake_fd, accounts_fd = map(int, sys.argv[1:5])
    link = EngineLink(data_fd, wake_fd, accounts_fd)
    link.report(Accounts())  # its process id, for the engine's logs
    watch = _EngineWatch(engine_pid)
    settings: dict[str, Any] | None = None
    exporting: _Exporting | None = None
    while True:
        closing = watch.gone or link.ended  # before the take: it then gets the last frames
        frames = link.take()
        for frame in frames:
            if settings is None:
                from kvcompose.tracing.exporters import span_exporter

                settings = frame
                exporter = span_exporter(settings["exporter"], settings["endpoint"])
                exporting = _Exporting(exporter, link.report, settings["service_name"], settings["version"])
            else:
                assert exporting is not None  # made from the first frame
                exporting.receive(frame)
        if closing or link.ended:
            break
        # Records came: read again in READ_EVERY_S (sooner if woken). None: wait for the next ship.
        watch.wait(link, idle=not frames, timeout_s=READ_EVERY_S if frames else CHECK_ENGINE_S)
    if exporting is not None and settings is not None:
        if lost := exporting.flush(settings["flush_s"]):
            _log_lost(settings, lost, settings["flush_s"])
    if watch.engine_died(within_s=ENGINE_END_WAIT_S):  # maybe killed before its atexit ran
        remove_files_of(engine_pid)
    sys.stderr.flush()
    os._exit(0)  # an export still running (a collector that does not answer) must not hold the process


if __name__ == "__main__":
    main()
