"""The hand-over: span batches from an engine process to its exporter process, through plain pipes.

Three pipes join an engine process to one exporter process:

- **data** (engine to exporter): frames, each a 4-byte length and a
  ``marshal`` payload. The first frame holds the settings; every later one is
  ``("t", [span templates])`` or ``("r", [span records])``.
- **wake** (engine to exporter): a byte that wakes an exporter reading on its
  schedule because the data pipe is half full, or says the engine is done.
- **accounts** (exporter to engine): the exporter's process id and span
  accounts (exported, dropped by reason), sent whole whenever they change;
  end-of-file the moment the exporter ends, however it ends.

A full data pipe refuses a batch whole (the shipper counts it dropped): the
engine's writes never block. The engine keeps the record frames that the
exporter has not read yet (the kernel says how many bytes wait in the pipe),
so that those of an exporter that died move to its replacement. Pipes have no
name: nothing is left in ``/dev/shm`` or anywhere else.

Why this and not a ring in shared memory (which this replaced): measured side
by side (``python -m benchmarks.span_transport``, docs/performance.md), the
ring's saved system call was worth at most 0.05% of a core to the engine
process, and with pipes the accounts travel as messages, not as counters two
processes write into one mapping.
"""

from __future__ import annotations

import array
import fcntl
import marshal
import os
import struct
import subprocess
import sys
import termios
import time
from collections import deque
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, NamedTuple

TEMPLATES_FRAME, RECORDS_FRAME = "t", "r"
WAKE, END = b"\1", b"\0"
_LENGTH = struct.Struct("<I")
_ACCOUNTS = struct.Struct("<6Q")  # pid, then Accounts' fields
# The data pipe's size: what may wait for an exporter that reads once a second (the most an unprivileged
# process gets by default: /proc/sys/fs/pipe-max-size).
PIPE_BYTES = 1 << 20
# A pipe's room is counted in pages: a page partly read still holds its slot. A frame is written only
# with this much more room than it needs, so that it goes in whole.
_SLACK = 2 * 4096
# The exporter's first process: it forks the exporter and exits at once, so that the exporter is not the
# engine's descendant (vLLM kills those: see kvcompose.tracing.export_process). An isolated interpreter
# without site packages starts in milliseconds: the exporter is out of the engine's tree before it imports.
# It first widens its CPU set to every core: vLLM's CPU backend pins the engine's threads to the cores its
# OpenMP threads keep busy, and an exporter that inherited the pin got no time beside them (its imports
# alone took minutes), so a server's spans waited until shutdown.
_LAUNCHER = (
    "import os, sys\n"
    "try:\n    os.sched_setaffinity(0, range(os.cpu_count() or 1))\n"
    "except (AttributeError, OSError):\n    pass\n"
    "if os.fork() == 0:\n    os.execv(sys.executable, [sys.executable, '-m', *sys.argv[1:]])\n"
)
EXPORTER_MODULE = "kvcompose.tracing.export_process"
# vLLM's CPU backend gives its worker processes these, with libgomp preloaded: the OpenMP runtime then binds a
# process's first thread to the worker's cores as it loads, in every process started from there with them. The
# exporter runs no OpenMP; it starts without them (and the launcher above drops the thread's own pin).
_OPENMP_PLACEMENT = ("GOMP_CPU_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY")


class Accounts(NamedTuple):
    """Where the spans an exporter received ended; each span ends in exactly one."""

    exported: int = 0
    queue_full: int = 0
    export_failed: int = 0
    unreadable: int = 0  # a record of a template it was never sent
    shutdown: int = 0  # still queued when its flush time ran out

    @property
    def settled(self) -> int:
        return sum(self)


def frame(value: Any) -> bytes:
    payload = marshal.dumps(value)
    return _LENGTH.pack(len(payload)) + payload


def _data_pipe() -> tuple[int, int]:
    read_end, write_end = os.pipe()
    try:
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:  # over this user's limits (pipe-max-size, pipe-user-pages-soft): the kernel's default
        pass
    os.set_blocking(write_end, False)
    return read_end, write_end


class ExporterLink:
    """The engine's end of the pipes to one exporter process (started by :meth:`start`, maybe later)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        # The engine keeps a read end of its own: writes never fail while no exporter reads (one died, or
        # its replacement waits), and what the pipe holds stays until this link is closed.
        self._data_read, self._data = _data_pipe()
        self.capacity = fcntl.fcntl(self._data, fcntl.F_GETPIPE_SZ)  # bytes the data pipe holds
        self._wake_read, self._wake = os.pipe()
        os.set_blocking(self._wake, False)
        self._written = 0  # bytes written to the data pipe, ever
        self._tail = b""  # the end of a frame the pipe did not take whole (it counted pages, not bytes)
        self._unread: deque[tuple[int, Sequence[Any]]] = deque()  # record frames maybe unread: (end, records)
        self.shipped = 0  # spans written to the data pipe
        self.accounts = Accounts()  # as the exporter last reported them
        self.pid: int | None = None  # the exporter's, once it reported
        self.launcher: subprocess.Popen[bytes] | None = None
        self._accounts_fd = -1
        self.started_at = 0.0
        self._write(frame(settings))

    @property
    def started(self) -> bool:
        return self.launcher is not None

    def start(self) -> None:
        accounts_read, accounts_write = os.pipe()
        package_root = str(Path(__file__).resolve().parents[2])
        env = {name: value for name, value in os.environ.items() if name not in _OPENMP_PLACEMENT}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        fds = (self._data_read, self._wake_read, accounts_write)
        try:
            self.launcher = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _LAUNCHER, EXPORTER_MODULE, str(os.getpid()), *map(str, fds)],
                stdin=subprocess.DEVNULL, env=env, close_fds=True, pass_fds=fds, start_new_session=True,
            )
        except BaseException:
            os.close(accounts_read)
            raise
        finally:
            os.close(accounts_write)
        self._accounts_fd, self.started_at = accounts_read, time.monotonic()

    # ---- the outboxes' thread ----

    def append(self, kind: str, items: Sequence[Any]) -> bool:
        """Write one frame; False (nothing written) when the pipe has no room for it. A frame that leaves the
        pipe half full wakes the exporter (an idle one waits on the data pipe itself)."""
        data = frame((kind, items))
        unread = self.unread()
        self._forget_read(unread)
        if (self._tail and not self._write_tail()) or len(data) + _SLACK > self.capacity - unread:
            return False
        self._write(data)
        if kind == RECORDS_FRAME:
            self._unread.append((self._written, items))
            self.shipped += len(items)
        if self.started and 2 * (unread + len(data)) > self.capacity:
            self._signal(WAKE)
        return True

    def _write(self, data: bytes) -> None:
        self._written += len(data)
        self._tail = data
        self._write_tail()

    def _write_tail(self) -> bool:
        """Write what the pipe takes of the tail; True once it took all."""
        try:
            taken = os.write(self._data, self._tail)
        except BlockingIOError:
            taken = 0
        self._tail = self._tail[taken:]
        return not self._tail

    def _forget_read(self, unread: int) -> None:
        """Drop the record frames the exporter has read whole."""
        read = self._written - len(self._tail) - unread
        while self._unread and self._unread[0][0] <= read:
            self._unread.popleft()

    def unread(self) -> int:
        """Bytes written to the data pipe that the exporter has not read (the kernel counts them)."""
        count = array.array("i", [0])
        fcntl.ioctl(self._data, termios.FIONREAD, count)
        return count[0]

    def _signal(self, byte: bytes) -> None:
        """A byte on the wake pipe. Never blocks: a full wake pipe already holds a wake-up."""
        try:
            os.write(self._wake, byte)
        except OSError:  # BlockingIOError (full), BrokenPipeError (it exited): nothing to wake
            pass

    # ---- the supervisor's thread ----

    def wait_for_end(self) -> None:
        """Take the exporter's accounts as they come; return once it has ended, however it ended."""
        assert self.launcher is not None
        self.launcher.wait()  # it exits as soon as it has forked the exporter
        pending = b""
        while chunk := os.read(self._accounts_fd, 4096):
            pending += chunk
            if whole := len(pending) - len(pending) % _ACCOUNTS.size:
                pid, *counts = _ACCOUNTS.unpack_from(pending, whole - _ACCOUNTS.size)
                self.pid, self.accounts, pending = pid, Accounts(*counts), pending[whole:]
        os.close(self._accounts_fd)

    def waiting(self) -> int:
        return self.shipped - self.accounts.settled

    def drops(self) -> dict[str, int]:
        """The spans the exporter dropped so far, by reason (as it reported them)."""
        accounts = self.accounts
        return {"queue_full": accounts.queue_full, "export_failed": accounts.export_failed + accounts.unreadable,
                "shutdown": accounts.shutdown}

    def unread_records(self) -> list[Sequence[Any]]:
        """The record batches the exporter had not read whole (it is gone; a new exporter is sent the settings
        and templates of its own)."""
        self._forget_read(self.unread())
        return [items for _, items in self._unread]

    def finish_input(self) -> None:
        """The engine ships nothing more: the exporter reads what is left, flushes and exits."""
        self._write_tail()
        self._signal(END)

    def close(self) -> None:
        """The exporter has ended: release the pipes (the unread data with them)."""
        for fd in (self._data, self._data_read, self._wake, self._wake_read):
            os.close(fd)


class EngineLink:
    """The exporter's end of the pipes: frames in, accounts out (arguments: the pipes' file descriptors)."""

    def __init__(self, data_fd: int, wake_fd: int, accounts_fd: int) -> None:
        self._data, self._wake, self._accounts = data_fd, wake_fd, accounts_fd
        os.set_blocking(data_fd, False)
        os.set_blocking(accounts_fd, False)
        self._pending = b""
        self.ended = False  # the engine said it is done, or its ends of the pipes closed

    def take(self) -> list[Any]:
        """Every whole frame written since the last take, in order."""
        chunks = [self._pending]
        while True:
            try:
                chunk = os.read(self._data, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                self.ended = True
                break
            chunks.append(chunk)
        data, frames, at = b"".join(chunks), [], 0
        while len(data) - at >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(data, at)
            if len(data) - at < _LENGTH.size + length:
                break  # not all of it is there yet
            frames.append(marshal.loads(data[at + _LENGTH.size:at + _LENGTH.size + length]))
            at += _LENGTH.size + length
        self._pending = data[at:]
        return frames

    def waited_on(self, idle: bool) -> list[int]:
        """What to wait on: the wake pipe; idle (its last take found nothing), the data pipe too."""
        return [self._wake, self._data] if idle else [self._wake]

    def woken(self, readable: Collection[int]) -> None:
        """Read the wake pipe if ``readable`` holds it: the engine may say it is done."""
        if self._wake in readable:
            signals = os.read(self._wake, 4096)
            if not signals or END in signals:
                self.ended = True

    def report(self, accounts: Accounts) -> None:
        """Send the accounts (with this process's id). Never blocks: an engine that does not read them (it is
        gone, or wedged) gets the next, which hold these."""
        try:
            os.write(self._accounts, _ACCOUNTS.pack(os.getpid(), *accounts))
        except OSError:
            pass
