"""What the composite sends from the scheduler to its workers each step, and what the workers send back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


class TracedRequest(NamedTuple):
    """A sampled request in a step, as the workers need it to join its trace."""

    request_id: str
    trace_id: int
    span_id: int  # of the request's span on the scheduler
    new: bool  # its first step: the prompt's KV is saved now


# Transfer summaries of traced requests, from the worker to the scheduler: request id -> (child name, direction)
# -> [lifetime s, copy s, bytes].
Summaries = dict[str, dict[tuple[str, str], list[float]]]


@dataclass(frozen=True)
class LoadPlan:
    """A child's load of one request, as the scheduler decided it."""

    child: int  # index of the loading child
    block_ids: tuple[int, ...]  # the blocks it fills (first KV cache group)
    load_async: bool


@dataclass
class KVComposeMetadata(KVConnectorMetadata):
    """One metadata object per child (pipeline order), plus shared bookkeeping."""

    per_child: tuple[KVConnectorMetadata | None, ...]
    # The scheduler's step number: every worker of a step sees the same one (load-error stats are keyed by it).
    step: int = 0
    # request id -> indices of the children that save it asynchronously; the
    # workers report it sent once all of them are done (or have failed).
    async_saves: dict[str, tuple[int, ...]] | None = None
    # Loads decided since the previous step, so a worker whose loading child
    # fails can report them for recompute; and loads the scheduler already
    # knows will not happen (the child failed while accepting them).
    loads: dict[str, LoadPlan] | None = None
    cancelled_loads: dict[str, LoadPlan] | None = None
    # Requests in their first step -> their blocks: saved now (for transfer tracking).
    saves: dict[str, int] | None = None
    # The step's sampled requests, so worker-side spans join their traces.
    traced_requests: tuple[TracedRequest, ...] | None = None
    # The workers send kvcompose's tables in this step's stats (once a second, and when flush_stats): all of them
    # at the same step.
    report_stats: bool = False
    # The step runs no forward pass (the engine is about to go idle, or waits): the workers report what changed
    # in this step's stats, as they may not take stats again for a while.
    flush_stats: bool = False
    # Prompt tokens the step prefills and the requests it decodes: the workers fit the engine's prefill cost
    # per token by them (kvcompose.instrumentation.economics).
    prefill_tokens: int = 0
    decode_tokens: int = 0


@dataclass
class KVComposeWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-child worker metadata (pipeline order; None where a child sent none), and what the transfers of traced
    requests did, for their request spans on the scheduler (only the worker that tracks transfers sends any)."""

    per_child: tuple[KVConnectorWorkerMetadata | None, ...]
    summaries: Summaries | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVComposeWorkerMetadata) or len(other.per_child) != len(self.per_child):
            raise TypeError(f"cannot aggregate KVComposeWorkerMetadata with {other!r}")
        merged = tuple(
            mine if theirs is None else theirs if mine is None else mine.aggregate(theirs)
            for mine, theirs in zip(self.per_child, other.per_child, strict=True)
        )
        return KVComposeWorkerMetadata(per_child=merged, summaries=self.summaries or other.summaries)
