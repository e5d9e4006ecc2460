"""The host memory an offloading worker copies KV blocks into: RAM, or a file mapped into RAM.

One flat int8 buffer holds, per engine KV tensor, ``num_chunks`` rows of that
tensor's chunk bytes, tensor after tensor.

A file-backed buffer (``host_buffer_dir``) maps an unnamed file in that
directory (``O_TMPFILE``; where the file system lacks it, a file removed as
soon as it is open) with ``MAP_SHARED``: its pages live in that file system's
page cache, and the kernel may write them back and reclaim them under memory
pressure. The file has no name, so nothing can truncate or replace it by path
under the engine (a shrunk mapped file would make the next copy fault with
SIGBUS and kill the worker), two workers can never share one, and nothing is
left behind when the engine ends, however it ends. Its disk blocks are
reserved at start-up (``posix_fallocate``): a disk too small for the budget
fails there, not with a SIGBUS when a store first writes a page.

Only its own process (and root) can still reach the file, through
``/proc/<pid>/fd``: truncating it there is tampering with the worker's memory,
and the next copy into a lost page kills the worker with SIGBUS. (A copy job
cannot fail cleanly instead: vLLM's ``OffloadingConnector`` asserts that every
job succeeded.)
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch


class HostBuffer:
    """``tensors[i]``: ``(num_chunks, chunk_bytes[i])`` int8 views into one allocation."""

    def __init__(self, chunk_bytes: Sequence[int], num_chunks: int, directory: Path | None = None) -> None:
        if num_chunks < 1:
            raise ValueError(f"a host buffer needs at least one chunk, got {num_chunks}")
        self.num_chunks = num_chunks
        self.nbytes = num_chunks * sum(chunk_bytes)
        self.directory = directory
        self._fd: int | None = None
        self._mapping: np.memmap | None = None
        flat = self._map_file(directory) if directory is not None else torch.zeros(self.nbytes, dtype=torch.int8)
        self.tensors: list[torch.Tensor] = []
        offset = 0
        for width in chunk_bytes:
            size = num_chunks * width
            self.tensors.append(flat[offset: offset + size].view(num_chunks, width))
            offset += size

    def _map_file(self, directory: Path) -> torch.Tensor:
        directory.mkdir(parents=True, exist_ok=True)
        fd = self._fd = _unnamed_file(directory)
        os.ftruncate(fd, self.nbytes)
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                self.close()
                raise OSError(error.errno, f"cannot reserve {self.nbytes} bytes for an offload host buffer in "
                                           f"{directory}: {error.strerror}") from None
            # EOPNOTSUPP and the like: the file stays sparse
        with open(fd, "r+b", closefd=False) as file:
            self._mapping = np.memmap(file, dtype=np.int8, mode="r+", shape=(self.nbytes,))
        return torch.from_numpy(self._mapping)

    def close(self) -> None:
        self.tensors = []
        self._mapping = None  # unmapped once no view is left
        if self._fd is not None:
            os.close(self._fd)  # the file, unnamed, is freed with its last mapping
            self._fd = None


def _unnamed_file(directory: Path) -> int:
    """A file in ``directory`` that has no name."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError):  # not Linux, or a file system without O_TMPFILE
        fd, path = tempfile.mkstemp(prefix=".kvcompose-offload-", dir=directory)
        os.unlink(path)
        return fd
