"""Where a process's span records go: an exporter process, or an exporter supplied in-process.

By default each engine process that traces starts one exporter process
(:mod:`kvcompose.tracing.export_process`) per tracing section and writes its
records to it through a pipe, a batch per step. The write never blocks: when
the pipe is full (the exporter is behind, or gone) the batch is dropped and
counted. :func:`set_span_exporter` replaces that, for the whole process, with
an exporter called in-process (tests, embedders with their own pipeline).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from opentelemetry.sdk.trace.export import SpanExporter

from kvcompose.config import TracingSection
from kvcompose.logs import get_logger
from kvcompose.tracing.export_process import encode_frame
from kvcompose.tracing.records import SpanRecord, resource_for, to_readable_spans

logger = get_logger("tracing")

PIPE_BYTES = 1 << 20  # asked of the kernel for the pipe to the exporter process
SHUTDOWN_WAIT_S = 2.5  # the exporter process flushes for at most 2 s
_F_SETPIPE_SZ = 1031  # Linux fcntl


class SpanShipper(Protocol):
    def ship(self, records: Sequence[SpanRecord]) -> None: ...

    def telemetry(self) -> tuple[int, int]:
        """(spans dropped since the last call, spans waiting for export now)."""
        ...

    def close(self) -> None: ...


class InProcessShipper:
    """Records become spans and are exported right away, in this process."""

    def __init__(self, exporter: SpanExporter, service_name: str, version: str) -> None:
        self._exporter = exporter
        self._resource = resource_for(service_name)
        self._version = version

    def ship(self, records: Sequence[SpanRecord]) -> None:
        self._exporter.export(to_readable_spans(records, self._resource, self._version))

    def telemetry(self) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None:
        pass


class DiscardingShipper:
    """``exporter: none``: spans are decided and recorded, then dropped uncounted."""

    def ship(self, records: Sequence[SpanRecord]) -> None:
        pass

    def telemetry(self) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None:
        pass


class ProcessShipper:
    """Writes record batches to this process's exporter process (started on the first batch)."""

    def __init__(self, section: TracingSection, version: str) -> None:
        self._settings = {"service_name": section.service_name, "exporter": section.exporter,
                          "endpoint": section.endpoint, "version": version}
        self._process: subprocess.Popen[bytes] | None = None
        self._pending = b""  # the tail of a batch the pipe had no room for
        self._dropped = 0  # since the last telemetry()
        self._reported_dropped = 0  # the exporter process's own count, as last read
        self._queued = 0
        self._status = b""

    def ship(self, records: Sequence[SpanRecord]) -> None:
        if self._process is None:
            self._start()
        if not self._write():  # the previous batch is still in the way
            self._dropped += len(records)
            return
        self._pending = encode_frame([tuple(record) for record in records])  # marshal takes plain tuples
        self._write()

    def _start(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "kvcompose.tracing.export_process"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, close_fds=True, start_new_session=True,
        )
        stdin, stdout = self._process.stdin, self._process.stdout
        assert stdin is not None and stdout is not None
        try:
            fcntl.fcntl(stdin.fileno(), _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # the default 64 KiB pipe still works; batches are dropped sooner
        os.set_blocking(stdin.fileno(), False)
        os.set_blocking(stdout.fileno(), False)
        self._pending = encode_frame(self._settings)
        self._write()
        atexit.register(self.close)

    def _write(self) -> bool:
        """Write what is pending; True once nothing is."""
        if not self._pending:
            return True
        assert self._process is not None and self._process.stdin is not None
        try:
            written = os.write(self._process.stdin.fileno(), self._pending)
        except BlockingIOError:
            return False
        except (BrokenPipeError, ValueError, OSError):
            self._pending = b""  # the exporter process is gone: what was pending is lost with it
            return True
        self._pending = self._pending[written:]
        return not self._pending

    def telemetry(self) -> tuple[int, int]:
        self._read_status()
        dropped, self._dropped = self._dropped, 0
        return dropped, self._queued

    def _read_status(self) -> None:
        if self._process is None or self._process.stdout is None:
            return
        try:
            chunk = os.read(self._process.stdout.fileno(), 4096)
        except (BlockingIOError, OSError, ValueError):
            return
        lines = (self._status + chunk).split(b"\n")
        self._status = lines.pop()
        for line in lines[-1:]:
            try:
                total_dropped, self._queued = (int(value) for value in line.split())
            except ValueError:
                continue
            self._dropped += max(0, total_dropped - self._reported_dropped)
            self._reported_dropped = total_dropped

    def close(self) -> None:
        """End of input: the exporter process flushes (at most 2 s) and exits."""
        process, self._process = self._process, None
        if process is None:
            return
        assert process.stdin is not None
        os.set_blocking(process.stdin.fileno(), True)
        try:
            if self._pending:
                process.stdin.write(self._pending)
            process.stdin.close()
            process.wait(SHUTDOWN_WAIT_S)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            process.kill()
        self._pending = b""


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
