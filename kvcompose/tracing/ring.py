"""A byte ring in anonymous shared memory, from one engine process to its exporter process.

One writer (the engine process) appends frames without a system call; one
reader (the exporter process) takes them when woken. The memory is an
anonymous file (``memfd_create``) that the exporter inherits as a file
descriptor: it has no name anywhere, so nothing is left behind in
``/dev/shm`` whichever process dies first, and the memory is freed when the
last of them closes it.

The header holds counters, each an 8-byte aligned little-endian integer
written by one side only:

- ``written`` (engine) and ``read`` (exporter): bytes ever appended and
  consumed; the ring's free room is its size less their difference.
- the exporter's span accounts: ``exported``, and dropped by reason
  (``queue_full``, ``export_failed``, ``unreadable``: a record of a template it
  was never sent, ``shutdown``: still queued when its flush time ran out). The
  engine subtracts them from the spans it appended to know how many wait, and,
  when the exporter dies, how many died with it.
- ``closed`` (engine): it shuts down; ``sleeping`` (exporter): set while it
  sleeps, so that the engine wakes it (through a pipe of their own) only then,
  or when the ring is half full; ``pid`` (exporter): its process id, for logs.

A frame is a 4-byte length and a ``marshal`` payload, wrapping at the end of
the data area. The writer stores the payload before it advances ``written``;
x86-64 and AArch64 Linux keep those stores in order for the reader closely
enough here, since the reader re-checks the length it reads against ``written``.
"""

from __future__ import annotations

import marshal
import mmap
import os
import struct
import tempfile
from typing import Any

_COUNTER = struct.Struct("<Q")
_LENGTH = struct.Struct("<I")
(WRITTEN, READ, EXPORTED, QUEUE_FULL, EXPORT_FAILED, UNREADABLE, SHUTDOWN_LOST, CLOSED, SLEEPING,
 PID) = (index * _COUNTER.size for index in range(10))
SETTLED = (EXPORTED, QUEUE_FULL, EXPORT_FAILED, UNREADABLE, SHUTDOWN_LOST)  # a span ends in exactly one of these
HEADER_BYTES = 128
DEFAULT_DATA_BYTES = 4 << 20


class Ring:
    """A mapped ring; :meth:`create` for the writer, :meth:`attach` for the reader. ``fd`` is the
    shared memory's file descriptor, which the writer hands to its reader's process."""

    def __init__(self, fd: int, mapped: mmap.mmap) -> None:
        self.fd = fd
        self._map = mapped
        self._size = len(mapped) - HEADER_BYTES
        self._written = self.counter(WRITTEN)  # the writer's own count, kept here: only it changes it

    @classmethod
    def create(cls, data_bytes: int = DEFAULT_DATA_BYTES) -> Ring:
        fd = _anonymous_file()
        os.ftruncate(fd, HEADER_BYTES + data_bytes)
        return cls(fd, mmap.mmap(fd, HEADER_BYTES + data_bytes))

    @classmethod
    def attach(cls, fd: int) -> Ring:
        return cls(fd, mmap.mmap(fd, os.fstat(fd).st_size))

    # ---- counters ----

    def counter(self, offset: int) -> int:
        return _COUNTER.unpack_from(self._map, offset)[0]

    def set_counter(self, offset: int, value: int) -> None:
        _COUNTER.pack_into(self._map, offset, value)

    def settled(self) -> int:
        """Spans the reader has exported or dropped, all reasons together."""
        return sum(self.counter(offset) for offset in SETTLED)

    # ---- writer ----

    def append(self, value: Any) -> bool:
        """Append one frame; False (nothing written) when the ring has no room for it."""
        payload = marshal.dumps(value)
        size = _LENGTH.size + len(payload)
        written = self._written
        if size > self._size - (written - self.counter(READ)):
            return False
        at = written % self._size
        if at + size <= self._size:  # the usual case: the frame does not wrap, and is written in place
            start = HEADER_BYTES + at
            _LENGTH.pack_into(self._map, start, len(payload))
            self._map[start + _LENGTH.size:start + size] = payload
        else:
            self._copy_in(at, _LENGTH.pack(len(payload)) + payload)
        self._written = written + size
        self.set_counter(WRITTEN, self._written)
        return True

    def half_full(self) -> bool:
        """Writer side: True when more than half the ring waits to be read."""
        return 2 * (self._written - self.counter(READ)) > self._size

    def _copy_in(self, at: int, data: bytes) -> None:
        first = min(len(data), self._size - at)
        start = HEADER_BYTES + at
        self._map[start:start + first] = data[:first]
        if first < len(data):
            self._map[HEADER_BYTES:HEADER_BYTES + len(data) - first] = data[first:]

    # ---- reader (and the writer, once its reader is gone) ----

    def take(self) -> list[Any]:
        """Every frame appended since the last take, in order."""
        values = []
        read, written = self.counter(READ), self.counter(WRITTEN)
        while written - read >= _LENGTH.size:
            (length,) = _LENGTH.unpack(self._copy_out(read % self._size, _LENGTH.size))
            if written - read < _LENGTH.size + length:
                break  # not all of it is there yet
            values.append(marshal.loads(self._copy_out((read + _LENGTH.size) % self._size, length)))
            read += _LENGTH.size + length
        self.set_counter(READ, read)
        return values

    def unread(self) -> bool:
        """True when frames were appended since the last take."""
        return self.counter(WRITTEN) != self.counter(READ)

    def _copy_out(self, at: int, length: int) -> bytes:
        first = min(length, self._size - at)
        start = HEADER_BYTES + at
        data = self._map[start:start + first]
        if first < length:
            data += self._map[HEADER_BYTES:HEADER_BYTES + length - first]
        return data

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


def _anonymous_file() -> int:
    """A file descriptor of memory with no name; where ``memfd_create`` is missing (not Linux), a
    temporary file unlinked at once."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("kvcompose-spans")
    fd, path = tempfile.mkstemp(prefix="kvcompose-spans-")
    os.unlink(path)
    return fd
