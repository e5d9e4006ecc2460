"""A byte ring in a shared file, from one engine process to its exporter process.

One writer (the engine process) appends frames without a system call; one
reader (the exporter process) takes them when woken. The header holds six
counters, each an 8-byte aligned little-endian integer:

- ``written`` and ``read``: bytes ever appended and consumed (the ring's free
  room is its size less their difference); each side only writes its own.
- ``dropped`` and ``queued``: the exporter's count of spans it dropped and of
  spans waiting for export, read by the engine for its metrics.
- ``closed``: set by the engine when it shuts down.
- ``sleeping``: set by the reader while it sleeps, so that the writer wakes it
  (through a pipe of their own) only then, or when the ring is half full.

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
from typing import Any

_COUNTER = struct.Struct("<Q")
_LENGTH = struct.Struct("<I")
WRITTEN, READ, DROPPED, QUEUED, CLOSED, SLEEPING = (index * _COUNTER.size for index in range(6))
HEADER_BYTES = 64
DEFAULT_DATA_BYTES = 4 << 20


class Ring:
    """A mapped ring; :meth:`create` for the writer, :meth:`attach` for the reader."""

    def __init__(self, path: str, mapped: mmap.mmap) -> None:
        self.path = path
        self._map = mapped
        self._size = len(mapped) - HEADER_BYTES
        self._written = self.counter(WRITTEN)  # the writer's own count, kept here: only it changes it

    @classmethod
    def create(cls, directory: str, data_bytes: int = DEFAULT_DATA_BYTES) -> Ring:
        fd, path = _temp_file(directory)
        try:
            os.ftruncate(fd, HEADER_BYTES + data_bytes)
            return cls(path, mmap.mmap(fd, HEADER_BYTES + data_bytes))
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, path: str) -> Ring:
        fd = os.open(path, os.O_RDWR)
        try:
            return cls(path, mmap.mmap(fd, os.fstat(fd).st_size))
        finally:
            os.close(fd)

    # ---- counters ----

    def counter(self, offset: int) -> int:
        return _COUNTER.unpack_from(self._map, offset)[0]

    def set_counter(self, offset: int, value: int) -> None:
        _COUNTER.pack_into(self._map, offset, value)

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

    # ---- reader ----

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


def _temp_file(directory: str) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(prefix="kvcompose-spans-", dir=directory)
