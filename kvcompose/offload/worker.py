"""An asynchronous ``OffloadingWorker`` for CPU engines: one thread copies KV blocks to and from host memory.

vLLM's ``OffloadingConnector`` hands the worker store jobs (engine -> host)
and load jobs (host -> engine) and polls ``get_finished`` every step. Here
``submit_store``/``submit_load`` only plan the row copies and queue the job;
a single copy thread runs the jobs in submission order (a load never
overtakes a store queued before it) and reports each one as finished only
after its last byte is copied. That is the contract vLLM relies on:

- loads are asynchronous in the connector (``get_num_new_matched_tokens``
  answers ``load_async=True``), so the request waits until its load job comes
  back from ``get_finished`` as ``finished_recving`` before any forward reads
  those blocks;
- before the scheduler reuses blocks that an unfinished store still reads, it
  names that job in ``jobs_to_flush`` and the connector calls ``wait`` on it
  ahead of the step's forward; ``wait`` returns only when those jobs are copied.

The copies are numpy row gathers/scatters over views of the same memory:
they release the GIL, so they overlap the engine's forward pass.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult

from kvcompose.logs import get_logger
from kvcompose.offload.block_mapping import RowCopy, plan_copies
from kvcompose.offload.copy_log import RECENT_COPIES, CopyLog, CopyRecord, Direction
from kvcompose.offload.host_buffer import HostBuffer

log = get_logger("offload")
COPY_THREAD_NAME = "kvcompose-offload-copy"


@dataclass(frozen=True)
class _Job:
    job_id: int
    direction: Direction
    copies: list[RowCopy]
    submitted_ns: int


class ThreadedCopyWorker(OffloadingWorker):
    """Copies between engine KV tensors (``(num_blocks, page)`` int8, on the CPU) and a :class:`HostBuffer`."""

    def __init__(
        self,
        engine_tensors: Sequence[torch.Tensor],
        host: HostBuffer,
        refs_per_group: Sequence[Sequence[Any]],
        blocks_per_chunk: int,
        copy_log: CopyLog = RECENT_COPIES,
    ) -> None:
        if len(engine_tensors) != len(host.tensors):
            raise ValueError(f"{len(engine_tensors)} engine KV tensors but {len(host.tensors)} host tensors")
        for index, (engine, held) in enumerate(zip(engine_tensors, host.tensors)):
            if engine.device.type != "cpu" or engine.dtype != torch.int8 or engine.ndim != 2:
                raise ValueError(
                    f"KV tensor {index} is {engine.dtype} {tuple(engine.shape)} on {engine.device}; "
                    "this worker copies 2-D int8 KV tensors of a CPU engine"
                )
            if held.shape[1] != engine.shape[1] * blocks_per_chunk:
                raise ValueError(f"host chunk of tensor {index} is {held.shape[1]} bytes, "
                                 f"not {blocks_per_chunk} x {engine.shape[1]}")
        # numpy views of the same memory: numpy's row gather/scatter releases the GIL and, unlike
        # torch's, starts no OpenMP team, which would compete with the engine's own threads.
        self._engine_rows = [engine.numpy() for engine in engine_tensors]
        self._host_rows = [held.view(-1, engine.shape[1]).numpy() for engine, held in zip(engine_tensors, host.tensors)]
        self._host = host
        self._refs_per_group = refs_per_group
        self._blocks_per_chunk = blocks_per_chunk
        self._copy_log = copy_log
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._changed = threading.Condition()
        self._pending: set[int] = set()
        self._finished: list[TransferResult] = []
        self._thread = threading.Thread(target=self._run, name=COPY_THREAD_NAME, daemon=True)
        self._thread.start()

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, "store", plan_copies(
            src_spec, dst_spec.block_ids, self._refs_per_group, self._blocks_per_chunk))

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, "load", plan_copies(
            dst_spec, src_spec.block_ids, self._refs_per_group, self._blocks_per_chunk))

    def _submit(self, job_id: int, direction: Direction, copies: list[RowCopy]) -> bool:
        if not self._thread.is_alive():
            raise RuntimeError("the offload copy thread has stopped")
        with self._changed:
            self._pending.add(job_id)
        self._jobs.put(_Job(job_id, direction, copies, time.time_ns()))
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._changed:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Return once every listed job that was submitted has been copied."""
        with self._changed:
            self._changed.wait_for(lambda: self._pending.isdisjoint(job_ids) or not self._thread.is_alive())
            if not self._pending.isdisjoint(job_ids):
                raise RuntimeError("the offload copy thread stopped with jobs still queued")

    def shutdown(self) -> None:
        """Finish the queued jobs, stop the thread, release the host buffer."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._host_rows = []  # the last views of a file-backed buffer: it is unmapped with them
        self._host.close()

    def _run(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                self._execute(job)
        finally:  # a waiter must not sleep on a thread that is gone
            with self._changed:
                self._changed.notify_all()

    def _execute(self, job: _Job) -> None:
        started_ns, started = time.time_ns(), time.perf_counter()
        try:
            for copy in job.copies:
                self._copy(job.direction, copy)
            success = True
        except Exception as error:  # reported to vLLM as a failed job, never raised in this thread
            log.error("offload copy failed", job_id=job.job_id, direction=job.direction,
                      error_type=type(error).__name__)
            success = False
        seconds = time.perf_counter() - started
        nbytes = sum(copy.nbytes for copy in job.copies) if success else 0
        self._copy_log.append(CopyRecord(job.job_id, job.direction, nbytes, seconds, job.submitted_ns, started_ns,
                                         time.time_ns(), threading.current_thread().name, success))
        log.debug("offload copy", job_id=job.job_id, direction=job.direction, bytes=nbytes, seconds=seconds)
        with self._changed:
            self._pending.discard(job.job_id)
            self._finished.append(TransferResult(job.job_id, success, nbytes, seconds))
            self._changed.notify_all()

    def _copy(self, direction: Direction, copy: RowCopy) -> None:
        engine = self._engine_rows[copy.tensor_index]
        host = self._host_rows[copy.tensor_index]
        width = copy.row_bytes
        if direction == "store":
            host[copy.host_rows, :width] = engine[copy.engine_rows, :width]
        else:
            engine[copy.engine_rows, :width] = host[copy.host_rows, :width]
