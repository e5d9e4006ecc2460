"""Where a process's span records go: an exporter process, or an exporter supplied in-process.

A tracer's records wait in its :class:`~kvcompose.tracing.outbox.Outbox`, which
its shipper makes; the outbox's thread hands them over in batches (a tenth of
a second's records), off the engine's thread. By default each engine process
that traces starts one exporter process
(:mod:`kvcompose.tracing.export_process`) per tracing section and appends its
records to a shared-memory :class:`~kvcompose.tracing.ring.Ring` that the
exporter reads: a batch costs a ``marshal`` and a copy, and a one-byte write
that wakes the exporter only if it sleeps (after an idle spell) or the ring is
half full. When
the ring is full (the exporter is behind, or gone) the batch is dropped and
counted. :func:`set_span_exporter` replaces that, for the whole process, with
an exporter called in-process (tests, embedders).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from opentelemetry.sdk.trace.export import SpanExporter

from kvcompose.config import TracingSection
from kvcompose.tracing import export_process
from kvcompose.tracing.export_process import RECORDS_FRAME, TEMPLATES_FRAME
from kvcompose.tracing.outbox import Outbox, drain_for
from kvcompose.tracing.records import SpanRecord, Templates, resource_for, to_readable_spans
from kvcompose.tracing.ring import CLOSED, DROPPED, QUEUED, READ, SLEEPING, Ring

SHUTDOWN_WAIT_S = 2.5  # the exporter process flushes for at most 2 s
STARTUP_WAIT_S = 10.0  # for an exporter process still starting when the engine shuts down
_SHARED_MEMORY = "/dev/shm"


class SpanShipper(Protocol):
    templates: Templates  # of every record shipped through it

    def outbox(self) -> Outbox:
        """A new outbox for a tracer's records, shipped here."""
        ...

    def ship(self, records: Sequence[SpanRecord]) -> None:
        """Called by the outboxes' thread (or a flush), one batch at a time."""
        ...

    def telemetry(self) -> tuple[int, int]:
        """(spans dropped since the last call, spans waiting for export now)."""
        ...

    def close(self) -> None:
        """Ship what its outboxes hold, then release what it holds."""
        ...


class _OutboxesShipped:
    """What every shipper does with its outboxes."""

    def outbox(self) -> Outbox:
        return Outbox(self)  # type: ignore[arg-type]

    def close(self) -> None:
        drain_for(self)  # type: ignore[arg-type]


class InProcessShipper(_OutboxesShipped):
    """Records become spans and are exported in this process, by the outboxes' thread."""

    def __init__(self, exporter: SpanExporter, service_name: str, version: str) -> None:
        self.templates = Templates()
        self._exporter = exporter
        self._resource = resource_for(service_name)
        self._version = version

    def ship(self, records: Sequence[SpanRecord]) -> None:
        self._exporter.export(to_readable_spans(records, self.templates.all, self._resource, self._version))

    def telemetry(self) -> tuple[int, int]:
        return 0, 0


class DiscardingShipper(_OutboxesShipped):
    """``exporter: none``: spans are decided and recorded, then dropped uncounted."""

    def __init__(self) -> None:
        self.templates = Templates()

    def ship(self, records: Sequence[SpanRecord]) -> None:
        pass

    def telemetry(self) -> tuple[int, int]:
        return 0, 0


class ProcessShipper(_OutboxesShipped):
    """Appends record batches to the ring of this process's exporter process (started on the first batch)."""

    def __init__(self, section: TracingSection, version: str) -> None:
        self._settings = {"service_name": section.service_name, "exporter": section.exporter,
                          "endpoint": section.endpoint, "version": version}
        self.templates = Templates()
        self._ring: Ring | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._wake_fd = -1  # the exporter's stdin, written to wake it
        # Spans dropped by this side (counted by the outboxes' thread), and as telemetry() last reported them;
        # two counters, each written by one thread.
        self._dropped = self._reported_own = 0
        self._reported_dropped = 0  # the exporter process's own count, as last read

    def ship(self, records: Sequence[SpanRecord]) -> None:
        if self._ring is None:
            self._start()
        assert self._ring is not None
        if (new := self.templates.unshipped()) and not self._ring.append((TEMPLATES_FRAME, new)):
            self._dropped += len(records)  # its records could not be read without it
            return
        self.templates.mark_shipped()
        if not self._ring.append((RECORDS_FRAME, records)):
            self._dropped += len(records)
        elif self._ring.counter(SLEEPING) or self._ring.half_full():
            self._wake_exporter()

    def _wake_exporter(self) -> None:
        """A byte on the exporter's stdin wakes it. Never blocks: a full pipe already holds a wake-up."""
        try:
            os.write(self._wake_fd, b"\1")
        except OSError:  # BlockingIOError (full), BrokenPipeError (it exited): nothing to wake
            pass

    def _start(self) -> None:
        self._ring = Ring.create(_SHARED_MEMORY if os.path.isdir(_SHARED_MEMORY) else tempfile.gettempdir())
        self._ring.append(self._settings)
        self.templates.mark_unshipped()  # after close(), this is a new exporter: it knows none
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self._process = subprocess.Popen(  # its stdin: closed by close(), or by the kernel when this process dies
            [sys.executable, "-m", export_process.__name__, self._ring.path],
            stdin=subprocess.PIPE, env=env, close_fds=True, start_new_session=True,
        )
        assert self._process.stdin is not None
        self._wake_fd = self._process.stdin.fileno()
        os.set_blocking(self._wake_fd, False)
        atexit.register(self.close)

    def telemetry(self) -> tuple[int, int]:
        if self._ring is None:
            return 0, 0
        total, own = self._ring.counter(DROPPED), self._dropped
        dropped = own - self._reported_own + max(0, total - self._reported_dropped)
        self._reported_own, self._reported_dropped = own, total
        return dropped, self._ring.counter(QUEUED)

    def close(self) -> None:
        """What the outboxes hold is shipped; the exporter process drains the ring, flushes (at most 2 s)
        and exits."""
        super().close()
        ring, process = self._ring, self._process
        self._ring = self._process = None
        if ring is None or process is None:
            return
        ring.set_counter(CLOSED, 1)
        if process.stdin is not None:
            process.stdin.close()  # wakes it at once
        deadline = time.monotonic() + STARTUP_WAIT_S
        while not ring.counter(READ) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # still importing: what it was sent would be lost
        try:
            process.wait(SHUTDOWN_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
        ring.close()
        Path(ring.path).unlink(missing_ok=True)


_lock = threading.Lock()
_shippers: dict[tuple[int, TracingSection], SpanShipper] = {}
_override: SpanExporter | None = None


def set_span_exporter(exporter: SpanExporter | None) -> None:
    """Export every pipeline's spans in this process through ``exporter`` (embedding kvcompose,
    tests); ``None`` goes back to the exporter process the pipeline asks for."""
    global _override
    _override = exporter


def shipper_for(section: TracingSection, version: str) -> SpanShipper:
    """This process's shipper for a pipeline's tracing section."""
    if _override is not None:
        return InProcessShipper(_override, section.service_name, version)
    if section.exporter == "none":
        return DiscardingShipper()
    key = (os.getpid(), section)
    with _lock:
        if (shipper := _shippers.get(key)) is None:
            shipper = _shippers[key] = ProcessShipper(section, version)
        return shipper
