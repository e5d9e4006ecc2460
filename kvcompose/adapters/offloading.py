"""vLLM's OffloadingConnector, as kvcompose reads it: its jobs, their completion and their measured copy times.

OffloadingConnector's transfers are jobs, not requests: its scheduler-side
metadata maps job ids to jobs (a request, a source and a destination spec)
per direction, and its worker metadata names the jobs completed since the
last step, with the bytes and seconds its workers measured copying them, per
direction (kvcompose's CPU offloading spec measures there too). Job ids are
read as strings, the keys kvcompose tracks them by.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from kvcompose.adapters.contract import Contract, default_lookup, missing_api
from kvcompose.adapters.contract import unmet as report_unmet
from kvcompose.operations import Direction

_COMMON = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"
CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector.OffloadingConnector"
METADATA = f"{_COMMON}.OffloadingConnectorMetadata"
WORKER_METADATA = f"{_COMMON}.OffloadingWorkerMetadata"

# Everything this module reads of vLLM (tests/test_adapters.py checks it on each supported release).
CONTRACT: Contract = {
    CONNECTOR: (),  # the class a child resolves to; kvcompose knows it by name (see kvcompose.adapters.completion)
    METADATA: ("load_jobs", "store_jobs"),  # job id -> TransferJob
    f"{_COMMON}.TransferJob": ("req_id", "src_spec", "dst_spec"),
    "vllm.v1.kv_offload.base.GPULoadStoreSpec": ("block_ids",),  # the engine's side of a job
    WORKER_METADATA: ("completed_jobs", "transfer_stats"),  # job id -> count; TransferStats
    f"{_COMMON}.TransferStats": ("load", "store"),
    f"{_COMMON}.DirectionalTransferStats": ("time",),  # seconds its workers spent copying
}


class Job(NamedTuple):
    direction: Direction
    job_id: str
    req_id: str
    blocks: int  # of the engine's KV cache


@functools.cache
def unmet() -> tuple[str, ...]:
    """What of :data:`CONTRACT` the installed vLLM lacks (warned once); while it lacks any, nothing is read."""
    return report_unmet("OffloadingConnector", missing_api(CONTRACT))


@functools.cache
def _read(dotted: str) -> type | tuple[()]:
    """The class at ``dotted``, whose instances this module reads; none (``()``) while the contract is unmet."""
    return () if unmet() else default_lookup(dotted)


def jobs(metadata: Any) -> Iterator[Job]:
    """The jobs a child's metadata issues (an OffloadingConnectorMetadata's; none of anything else)."""
    if not isinstance(metadata, _read(METADATA)):
        return
    for job_id, job in metadata.load_jobs.items():
        yield Job("load", str(job_id), job.req_id, len(job.dst_spec.block_ids))
    for job_id, job in metadata.store_jobs.items():
        yield Job("save", str(job_id), job.req_id, len(job.src_spec.block_ids))


def job_requests(children_metadata: Iterable[Any]) -> set[str]:
    """The requests whose jobs these children's metadata issue."""
    return {job.req_id for metadata in children_metadata for job in jobs(metadata)}


def completed_jobs(worker_meta: Any) -> list[str]:
    """The jobs a child's worker metadata reports completed (an OffloadingWorkerMetadata's)."""
    if not isinstance(worker_meta, _read(WORKER_METADATA)):
        return []
    return [str(job_id) for job_id in worker_meta.completed_jobs]


def copy_seconds(worker_meta: Any, direction: Direction) -> float | None:
    """The seconds the workers spent copying the completed jobs of ``direction`` that a child's worker metadata
    (an OffloadingWorkerMetadata) reports."""
    if not isinstance(worker_meta, _read(WORKER_METADATA)):
        return None
    stats = worker_meta.transfer_stats
    return (stats.load if direction == "load" else stats.store).time
