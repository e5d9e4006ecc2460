"""Which engine KV rows pair with which host-buffer rows for one transfer job.

The scheduler describes a job with a ``GPULoadStoreSpec`` (engine block ids,
listed group by group: ``group_sizes[g]`` of them for KV cache group ``g``,
the first being the request's ``block_indices[g]``-th block) and the host
chunk ids of vLLM's CPU offloading manager. One host chunk holds
``blocks_per_chunk`` engine blocks back to back, so a host buffer of
``(num_chunks, blocks_per_chunk * page)`` bytes per engine tensor is read as
``num_chunks * blocks_per_chunk`` rows of ``page`` bytes; block ``j`` of
chunk ``c`` is row ``c * blocks_per_chunk + j``. A group whose first block
sits mid-chunk (``block_indices[g] % blocks_per_chunk != 0``) skips the
chunk's leading rows, as vLLM's own CPU worker does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RowCopy:
    """Copy ``row_bytes`` leading bytes of each listed row, between one engine tensor and its host rows."""

    tensor_index: int
    engine_rows: np.ndarray  # int64 row ids into the engine tensor
    host_rows: np.ndarray  # int64 row ids into the host rows of that tensor, same length
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return len(self.engine_rows) * self.row_bytes


def host_rows_of(chunk_ids: np.ndarray, blocks_per_chunk: int, skip: int, count: int) -> np.ndarray:
    """Host row ids of ``count`` engine blocks stored from the ``skip``-th block of the first chunk on."""
    rows = (chunk_ids.astype(np.int64)[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk)).ravel()
    return rows[skip: skip + count]


def plan_copies(
    engine_spec: Any, chunk_ids: np.ndarray, refs_per_group: Sequence[Sequence[Any]], blocks_per_chunk: int
) -> list[RowCopy]:
    """The row copies of one job, one per KV cache group and engine tensor that group uses.

    ``engine_spec`` is vLLM's ``GPULoadStoreSpec``; ``refs_per_group`` is
    ``CanonicalKVCaches.group_data_refs`` (each ref names a tensor and the
    unpadded page bytes of one layer; layers sharing a tensor are copied once).
    """
    group_sizes, block_indices = engine_spec.group_sizes, engine_spec.block_indices
    if len(group_sizes) != len(refs_per_group) or len(block_indices) != len(refs_per_group):
        raise ValueError(f"job covers {len(group_sizes)} KV cache groups, the engine has {len(refs_per_group)}")
    engine_blocks = np.asarray(engine_spec.block_ids, dtype=np.int64)
    chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
    copies: list[RowCopy] = []
    block_offset = chunk_offset = 0
    for size, first_block, refs in zip(group_sizes, block_indices, refs_per_group):
        if size == 0:
            continue
        skip = first_block % blocks_per_chunk
        num_chunks = -(-(size + skip) // blocks_per_chunk)
        group_chunks = chunk_ids[chunk_offset: chunk_offset + num_chunks]
        group_blocks = engine_blocks[block_offset: block_offset + size]
        if len(group_chunks) != num_chunks or len(group_blocks) != size:
            raise ValueError("job lists fewer blocks or chunks than its group sizes need")
        engine_rows = group_blocks
        host_rows = host_rows_of(group_chunks, blocks_per_chunk, skip, size)
        row_bytes: dict[int, int] = {}
        for ref in refs:
            row_bytes[ref.tensor_idx] = max(row_bytes.get(ref.tensor_idx, 0), ref.page_size_bytes)
        copies.extend(RowCopy(index, engine_rows, host_rows, width) for index, width in row_bytes.items())
        block_offset += size
        chunk_offset += num_chunks
    if block_offset != len(engine_blocks) or chunk_offset != len(chunk_ids):
        raise ValueError(
            f"job lists {len(engine_blocks)} blocks and {len(chunk_ids)} chunks; its groups use "
            f"{block_offset} and {chunk_offset}"
        )
    return copies
