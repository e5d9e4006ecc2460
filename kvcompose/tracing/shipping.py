"""Where a process's span records go: a supervised exporter process, or an exporter supplied in-process.

A tracer's records wait in its :class:`~kvcompose.tracing.outbox.Outbox`, which
its shipper makes; the outbox's thread hands them over in batches (a tenth of
a second's records), off the engine's thread. By default each engine process
that traces starts one exporter process
(:mod:`kvcompose.tracing.export_process`) per tracing section and writes its
records to a pipe that the exporter reads (:mod:`kvcompose.tracing.handover`):
a batch costs a ``marshal`` and a ``write``. When the pipe is full (the
exporter is behind) the batch is dropped and counted.
:func:`set_span_exporter` replaces that, for the whole process, with an
exporter called in-process (tests, embedders).

Supervision: a thread per exporter process reads the accounts it sends (no
CPU between them) until end-of-file, the moment it ends, however it ends.
Then:

- logs it (one line; a process dying again and again: one a minute);
- counts as dropped (``exporter_down``) the spans that died with it: those it
  had read and neither exported nor counted;
- moves what it had not read yet into a new pipe, and starts a new exporter
  on it after a back-off (:data:`FIRST_RESTART_S`, doubling up to
  :data:`MAX_RESTART_S`; back to the first once an exporter lived that long).
  Records shipped meanwhile wait in the new pipe; what does not fit is dropped
  as ``exporter_down``.

Shutdown: :meth:`ProcessShipper.close` (the last tracer of the process closing,
or the interpreter exiting) ships what the outboxes hold and tells the exporter
to finish, without waiting for it: the exporter is not the engine's descendant
(see the exporter's module), so it exports what it holds within the pipeline's
``tracing.shutdown_flush_s`` even when vLLM kills the engine's whole process
tree right away, and counts and logs what it cannot. Records still in an
outbox when the engine is killed outright are lost: at most a drain interval's.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from opentelemetry.sdk.trace.export import SpanExporter

from kvcompose.config import LoggingSection, TracingSection
from kvcompose.logs import get_logger
from kvcompose.wire.telemetry import DROP_REASONS, TelemetryCounters
from kvcompose.tracing.handover import RECORDS_FRAME, TEMPLATES_FRAME, ExporterLink
from kvcompose.tracing.outbox import Outbox, drain_for
from kvcompose.tracing.records import SpanRecord, Templates, resource_for, to_readable_spans

FIRST_RESTART_S = 0.5
MAX_RESTART_S = 30.0
log = get_logger("tracing")


class SpanShipper(Protocol):
    templates: Templates  # of every record shipped through it

    def outbox(self) -> Outbox:
        """A new outbox for a tracer's records, shipped here."""
        ...

    def ship(self, records: Sequence[SpanRecord]) -> None:
        """Called by the outboxes' thread (or a flush), one batch at a time."""
        ...

    def telemetry(self) -> TelemetryCounters | None:
        """Spans dropped (by reason) and exporter restarts since the last call, and the spans waiting now;
        None when nothing changed."""
        ...

    def queued(self) -> int:
        """Spans shipped and not yet exported or dropped."""
        ...

    def release(self, outbox: Outbox) -> None:
        """The outbox's tracer is done: ship what it holds; the last one closes the shipper."""
        ...

    def close(self) -> None:
        """Ship what its outboxes hold, then release what it holds."""
        ...


class _OutboxesShipped:
    """What every shipper does with its outboxes."""

    def __init__(self) -> None:
        self._open_outboxes = 0

    def outbox(self) -> Outbox:
        self._open_outboxes += 1
        return Outbox(self)  # type: ignore[arg-type]

    def release(self, outbox: Outbox) -> None:
        drain_for(self)  # type: ignore[arg-type]
        self._open_outboxes -= 1
        if self._open_outboxes <= 0:
            self.close()

    def close(self) -> None:
        drain_for(self)  # type: ignore[arg-type]

    def telemetry(self) -> TelemetryCounters | None:
        return None

    def queued(self) -> int:
        return 0


class InProcessShipper(_OutboxesShipped):
    """Records become spans and are exported in this process, by the outboxes' thread."""

    def __init__(self, exporter: SpanExporter, service_name: str, version: str) -> None:
        super().__init__()
        self.templates = Templates()
        self._exporter = exporter
        self._resource = resource_for(service_name)
        self._version = version

    def ship(self, records: Sequence[SpanRecord]) -> None:
        self._exporter.export(to_readable_spans(records, self.templates.all, self._resource, self._version))


class DiscardingShipper(_OutboxesShipped):
    """``exporter: none``: spans are decided and recorded, then dropped uncounted."""

    def __init__(self) -> None:
        super().__init__()
        self.templates = Templates()

    def ship(self, records: Sequence[SpanRecord]) -> None:
        pass


class ProcessShipper(_OutboxesShipped):
    """Writes record batches to the pipe of this process's exporter process (started with the first outbox, or
    the first batch), and keeps that process running; see the module docstring."""

    def __init__(self, section: TracingSection, version: str, logging: LoggingSection | None = None) -> None:
        super().__init__()
        logging = logging or LoggingSection()
        self._flush_s = section.shutdown_flush_s
        self._settings = {"service_name": section.service_name, "exporter": section.exporter,
                          "endpoint": section.endpoint, "version": version, "flush_s": self._flush_s,
                          "log_format": logging.format, "log_level": logging.level}
        self.templates = Templates()
        self._owner = os.getpid()  # a forked child inherits this object, not the exporter
        self._lock = threading.Lock()  # the outboxes' thread ships, a supervisor replaces, close() ends
        self._exporter: ExporterLink | None = None
        self._closing: list[ExporterLink] = []  # closed, still exporting what they hold
        # Spans dropped so far by this side and by exporters that are gone (the current one's own counts are
        # added when read), and what telemetry() last reported.
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        self._restarts = 0
        self._reported: tuple[dict[str, int], int, int] = (dict.fromkeys(DROP_REASONS, 0), 0, 0)
        self._restart_in_s = FIRST_RESTART_S
        self._death_logged_at = -float("inf")
        self._deaths_not_logged = 0
        self._at_exit = False

    def outbox(self) -> Outbox:
        """A tracer's outbox; its exporter starts now, ahead of the first spans (an exporter still starting
        when the engine is killed dies with what it was sent)."""
        with self._lock:
            if self._exporter is None:
                self._start()
        return super().outbox()

    # ---- the outboxes' thread ----

    def ship(self, records: Sequence[SpanRecord]) -> None:
        with self._lock:
            exporter = self._exporter or self._start()
            reason = "queue_full" if exporter.started else "exporter_down"
            if (new := self.templates.unshipped()) and not exporter.append(TEMPLATES_FRAME, new):
                self._dropped[reason] += len(records)  # its records could not be read without it
                return
            self.templates.mark_shipped()
            if not exporter.append(RECORDS_FRAME, records):
                self._dropped[reason] += len(records)

    def _start(self) -> ExporterLink:
        """A new exporter (the first, or the first after close())."""
        exporter = self._exporter = ExporterLink(self._settings)
        self.templates.mark_unshipped()  # a new exporter knows no template
        self._launch(exporter)
        if not self._at_exit:
            self._at_exit = True
            atexit.register(self.close)
        return exporter

    def _launch(self, exporter: ExporterLink) -> None:
        exporter.start()
        threading.Thread(target=self._supervise, args=(exporter,), name="kvcompose-span-exporter-watch",
                         daemon=True).start()

    # ---- a supervisor's thread, one per exporter process started ----

    def _supervise(self, exporter: ExporterLink) -> None:
        exporter.wait_for_end()
        with self._lock:
            if exporter in self._closing:  # closed: it has flushed
                self._closing.remove(exporter)
                self._settle_closed(exporter)
                return
            replacement, lost = self._replace(exporter)
            lived_s = time.monotonic() - exporter.started_at
            delay = FIRST_RESTART_S if lived_s >= MAX_RESTART_S else self._restart_in_s
            self._restart_in_s = min(2 * delay, MAX_RESTART_S)
            exporter.close()
        self._log_death(exporter.pid, lost, lived_s, delay)
        while True:
            time.sleep(delay)
            with self._lock:
                if replacement is not self._exporter or replacement.started:  # closed: close() started it
                    return
                try:
                    self._launch(replacement)
                except OSError as error:  # no process could start (out of memory, no more pids)
                    log.error("span_exporter_start_failed", error_type=type(error).__name__)
                    delay = MAX_RESTART_S
                    continue
                self._restarts += 1
                return

    def _replace(self, dead: ExporterLink) -> tuple[ExporterLink, int]:
        """A new, not yet started exporter holding what ``dead`` had not read; the spans that died with it."""
        unread = dead.unread_records()
        for reason, spans in dead.drops().items():
            self._dropped[reason] += spans
        lost = dead.waiting() - sum(len(items) for items in unread)
        self._dropped["exporter_down"] += lost
        replacement = self._exporter = ExporterLink(self._settings)
        self.templates.mark_unshipped()
        if self.templates.all:
            replacement.append(TEMPLATES_FRAME, self.templates.unshipped())
            self.templates.mark_shipped()
        for items in unread:
            if not replacement.append(RECORDS_FRAME, items):
                self._dropped["exporter_down"] += len(items)
        return replacement, lost

    def _settle_closed(self, exporter: ExporterLink) -> None:
        """Account for an exporter that ended after close(): what it counted, and what it ended without
        counting (it died while flushing)."""
        for reason, spans in exporter.drops().items():
            self._dropped[reason] += spans
        if unaccounted := exporter.waiting():
            self._dropped["shutdown"] += unaccounted
            log.warning("spans_lost_at_shutdown", spans=unaccounted, pid=exporter.pid)
        exporter.close()

    def _log_death(self, pid: int | None, lost: int, lived_s: float, restart_in_s: float) -> None:
        """One line per death; an exporter that dies again and again: one line a minute, counting the others."""
        now = time.monotonic()
        if now - self._death_logged_at < MAX_RESTART_S * 2:
            self._deaths_not_logged += 1
            return
        self._death_logged_at, held_back, self._deaths_not_logged = now, self._deaths_not_logged, 0
        log.error("span_exporter_died", pid=pid, engine_pid=os.getpid(), lived_s=round(lived_s, 1), spans_lost=lost,
                  restart_in_s=restart_in_s, **({"deaths_not_logged": held_back} if held_back else {}))

    # ---- the engine's stats and live view ----

    def _running(self) -> list[ExporterLink]:
        return self._closing + ([self._exporter] if self._exporter is not None else [])

    def telemetry(self) -> TelemetryCounters | None:
        with self._lock:
            drops = dict(self._dropped)
            for exporter in self._running():
                for reason, spans in exporter.drops().items():
                    drops[reason] += spans
            restarts, queued = self._restarts, sum(exporter.waiting() for exporter in self._running())
        reported_drops, reported_restarts, reported_queued = self._reported
        new_drops = {reason: spans - reported_drops[reason] for reason, spans in drops.items()
                     if spans > reported_drops[reason]}
        if not new_drops and restarts == reported_restarts and queued == reported_queued:
            return None
        # An exporter's counts move from it to this side when it ends: never report them twice.
        self._reported = {reason: max(spans, reported_drops[reason]) for reason, spans in drops.items()}, \
            restarts, queued
        return TelemetryCounters(new_drops, queued, restarts - reported_restarts)

    def queued(self) -> int:
        with self._lock:
            return sum(exporter.waiting() for exporter in self._running())

    # ---- shutdown ----

    def close(self) -> None:
        """Ship what the outboxes hold and tell the exporter to finish: it exports what it has for at most
        ``tracing.shutdown_flush_s`` and exits, on its own. Returns at once: vLLM gives its engine processes
        a few seconds to shut down (its worker processes most of them), and a wait here would take from that;
        the exporter, outside the engine's process tree, needs no engine to finish."""
        if os.getpid() != self._owner:
            return
        super().close()
        with self._lock:
            exporter, self._exporter = self._exporter, None
            if exporter is None:
                return
            if not exporter.started:  # waiting to be restarted: start it now, to export what it holds
                try:
                    self._launch(exporter)
                except OSError as error:
                    self._dropped["shutdown"] += exporter.waiting()
                    log.error("span_exporter_start_failed", error_type=type(error).__name__,
                              spans_lost=exporter.waiting())
                    exporter.close()
                    return
            exporter.finish_input()
            self._closing.append(exporter)


_lock = threading.Lock()
_shippers: dict[tuple[int, TracingSection], SpanShipper] = {}
_override: SpanExporter | None = None


def set_span_exporter(exporter: SpanExporter | None) -> None:
    """Export every pipeline's spans in this process through ``exporter`` (embedding kvcompose,
    tests); ``None`` goes back to the exporter process the pipeline asks for."""
    global _override
    _override = exporter


def shipper_for(section: TracingSection, version: str, logging: LoggingSection | None = None) -> SpanShipper:
    """This process's shipper for a pipeline's tracing section (``logging``: how its exporter logs)."""
    if _override is not None:
        return InProcessShipper(_override, section.service_name, version)
    if section.exporter == "none":
        return DiscardingShipper()
    key = (os.getpid(), section)
    with _lock:
        if (shipper := _shippers.get(key)) is None:
            shipper = _shippers[key] = ProcessShipper(section, version, logging)
        return shipper
