"""The host memory an offloading worker copies KV blocks into: RAM, or a file mapped into RAM.

One flat int8 buffer holds, per engine KV tensor, ``num_chunks`` rows of that
tensor's chunk bytes, tensor after tensor. File-backed buffers map a file
(``MAP_SHARED`` through ``numpy.memmap``), so every stored block is written
to the file and every load reads it back from there; the file is locked
(``flock``) while the worker holds it, so two workers never share one. Its
disk blocks are reserved at start-up (``posix_fallocate``): a disk too small
for the budget fails there, not with a SIGBUS when a store first writes a page.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch


class HostBufferInUseError(RuntimeError):
    """Another worker (this process or another) holds the buffer file."""


class HostBuffer:
    """``tensors[i]``: ``(num_chunks, chunk_bytes[i])`` int8 views into one allocation."""

    def __init__(self, chunk_bytes: Sequence[int], num_chunks: int, path: Path | None = None) -> None:
        if num_chunks < 1:
            raise ValueError(f"a host buffer needs at least one chunk, got {num_chunks}")
        self.num_chunks = num_chunks
        self.nbytes = num_chunks * sum(chunk_bytes)
        self.path = path
        self._lock_fd: int | None = None
        self._mapping: np.memmap | None = None
        flat = self._map_file(path) if path is not None else torch.zeros(self.nbytes, dtype=torch.int8)
        self.tensors: list[torch.Tensor] = []
        offset = 0
        for width in chunk_bytes:
            size = num_chunks * width
            self.tensors.append(flat[offset: offset + size].view(num_chunks, width))
            offset += size

    def _map_file(self, path: Path) -> torch.Tensor:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise HostBufferInUseError(f"offload host buffer file {path} is in use by another worker") from None
        self._lock_fd = fd
        os.ftruncate(fd, self.nbytes)  # keeps what a previous run wrote when the size is unchanged
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                self.close()
                raise OSError(error.errno, f"cannot reserve {self.nbytes} bytes for offload host buffer file {path}: "
                                           f"{error.strerror}") from None
            # EOPNOTSUPP and the like: the file stays sparse
        self._mapping = np.memmap(path, dtype=np.int8, mode="r+", shape=(self.nbytes,))
        return torch.from_numpy(self._mapping)

    def flush(self) -> None:
        """Write the mapped pages of a file-backed buffer to the file now (a no-op in RAM)."""
        if self._mapping is not None:
            self._mapping.flush()

    def close(self) -> None:
        self.flush()
        self.tensors = []
        self._mapping = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
