"""Transfers: one request, one child, one direction, from the step that issues it to its completion.

A child call returns long before an asynchronous child's copy is done, so
transfers are tracked apart from calls, on the worker, by how each kind of
child reports completion:

- **sync** (ExampleConnector, most storage connectors): a load completes when
  its child's last load wait of the step returns (``start_load_kv`` or the last
  ``wait_for_layer_load``, which for layer-wise loaders overlaps the forward
  pass); a save of a request in its first step completes when that step's
  ``wait_for_save`` returns.
- **async loads** (any child that answered ``load_async``): from the step that
  issues the load until ``get_transfer_results`` names the request.
- **finish** (NIXL): the send to a decode server is a save from the request's
  end until the child reports it in ``finished_sending``.
- **jobs** (vLLM's OffloadingConnector): each load or store job its metadata
  issues, until the job appears in its worker metadata's ``completed_jobs``
  (the scheduler names those jobs' requests among the step's traced requests).

Three times tell a transfer's story:

- **lifetime**: from the step that issues it until the engine learns it is
  done. For a load, what the request waits; for a save, how long its blocks
  stay held (a synchronous layer-wise save's lifetime holds the forward pass).
- **copy**: the time the mover spent moving the bytes. From the child's own
  measurement where it reports one (source ``child``): OffloadingConnector's
  job results in its worker metadata (kvcompose's CPU offloading spec reports
  there too), NIXL's transfer telemetry in its stats (the decode side's
  loads). Otherwise, for a synchronous transfer, the time inside the child's
  blocking calls of that step and direction, shared among the step's transfers
  of that child by their blocks (source ``calls``). An asynchronous transfer
  of a child that measures nothing has no copy time.
- **engine wait**: not per transfer but per child and direction, the time the
  forward pass spent inside the child's blocking calls (see
  ``Operation.blocking``), counted by the instrumentation.

A transfer ends ``failed`` when its child failed in that step or reported the
load failed (a sync load: when one of its blocks was reported failed, by its
child or by kvcompose giving a failed child's loads back to vLLM; a loader
that fails in a save leaves its finished loads done), and ``aborted`` when
vLLM finished its request first or it outlived :data:`EXPIRY_S`. Each ended
transfer is one observation of the transfer metrics and, for a traced request,
a ``kvcompose.transfer <direction> <child>`` span and a line of its request's
summary. With tensor parallelism only the first worker tracks, and bytes
count every worker's shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from time import time_ns
from typing import TYPE_CHECKING, Any, Protocol

from kvcompose.adapters import nixl, offloading
from kvcompose.adapters.completion import CopySource, completion_mode
from kvcompose.logs import get_logger
from kvcompose.operations import DIRECTIONS, Direction, Outcome

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvcompose.child_spec import ChildSpec
    from kvcompose.metrics.transfers import TransferRecorder
    from kvcompose.tracing.pipeline import PipelineTracer, SpanContextIds
    from kvcompose.wire.metadata import KVComposeMetadata

logger = get_logger("transfers")

EXPIRY_S = 600.0  # an open transfer older than this ends as aborted
FAILED_TRANSFER = "kvcompose.transfer_failed"  # error.type of a failure the child reported without raising
_EXPIRY_NS = int(EXPIRY_S * 1e9)
_EXPIRY_CHECK_NS = 1_000_000_000


def is_first_worker() -> bool:
    """True on the first tensor-parallel worker (the one that tracks transfers), or without TP."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except Exception:  # no parallel state (a connector built outside an engine)
        return True


def bytes_per_block(kv_cache_config: KVCacheConfig | None, tensor_parallel_size: int) -> int:
    """Bytes of one block over every layer of every KV cache group, across the engine's TP workers."""
    if kv_cache_config is None:
        return 0
    per_worker = sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names)
                     for group in kv_cache_config.kv_cache_groups)
    return per_worker * tensor_parallel_size


@dataclass(slots=True)
class Transfer:
    child: int
    direction: Direction
    req_id: str
    blocks: int
    start_ns: int
    context: SpanContextIds | None  # the traced request's span, else None
    block_ids: tuple[int, ...] = ()  # a sync load's: a load error on one of them fails it
    aborted: bool = False  # vLLM finished the request while it ran


@dataclass(slots=True)
class _Step:
    """What the bound step moves synchronously."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


class StepWaits:
    """The time each child's blocking calls took in the bound step, by direction, and when its last load wait
    returned (the end of its synchronous loads): told by the instrumentation's observed calls."""

    __slots__ = ("seconds", "load_end_ns")

    def __init__(self, children: int) -> None:
        self.seconds = [0.0] * (children * len(DIRECTIONS))  # at slot(child, direction)
        self.load_end_ns = [0] * children  # 0: no load wait this step

    @staticmethod
    def slot(child: int, direction: Direction) -> int:
        return child * len(DIRECTIONS) + DIRECTIONS.index(direction)

    def of(self, child: int, direction: Direction) -> float:
        return self.seconds[self.slot(child, direction)]

    def clear(self) -> None:
        self.seconds[:] = [0.0] * len(self.seconds)
        self.load_end_ns[:] = [0] * len(self.load_end_ns)


class GuardRecord(Protocol):
    """What the tracker reads of a child's guard: whether the child failed during a step, and how."""

    failures: int  # failed calls so far
    last_error_type: str  # of the latest failure


class TransferTracker:
    """The transfers of one worker-side composite; see the module docstring."""

    def __init__(
        self, specs: Sequence[ChildSpec], guards: Sequence[GuardRecord], block_bytes: int,
        recorder: TransferRecorder, tracer: PipelineTracer | None,
    ) -> None:
        self._specs = specs
        self._guards = guards
        self._modes = [completion_mode(spec.connector_cls) for spec in specs]
        self._sync_savers = [spec.index for spec in specs if spec.config.save and self._modes[spec.index] == "sync"]
        self._block_bytes = block_bytes
        self._recorder = recorder
        self._tracer = tracer
        self._step = _Step()
        self.waits = StepWaits(len(specs))
        self._bound_at = 0  # when the step was bound (ns since the epoch): every transfer it issues starts then
        self._contexts: Mapping[str, SpanContextIds] = {}  # the bound step's traced requests, by request id
        self._failures_at_bind: list[int] = []
        self._load_error_blocks: set[int] = set()
        self._open: dict[tuple[int, str, str], Transfer] = {}  # (child, request or job id, direction)
        # NIXL loads done this step, (transfer, end), whose copy time comes with the child's stats of the step.
        self._awaiting_copy: list[tuple[Transfer, int]] = []
        self._summaries: dict[str, dict[tuple[str, Direction], list[float]]] = {}  # traced request -> lines
        self._next_expiry_check = 0

    # ---- the step ----

    def begin_step(self, metadata: KVComposeMetadata, contexts: Mapping[str, SpanContextIds]) -> bool:
        """Open the transfers the step's metadata issues (``contexts``: its traced requests' spans); True if the
        step moves KV or transfers are open (its blocking calls are then timed, into :attr:`waits`)."""
        self._failures_at_bind = [guard.failures for guard in self._guards]
        self._bound_at = time_ns()
        self._contexts = contexts
        step = self._step = _Step()
        self.waits.clear()
        for req_id, plan in (metadata.loads or {}).items():
            if self._modes[plan.child] == "jobs":
                continue  # its jobs say more, below
            transfer = self._start(plan.child, "load", req_id, len(plan.block_ids))
            if plan.load_async:
                self._open[(plan.child, req_id, "load")] = transfer
            else:
                transfer.block_ids = plan.block_ids
                step.loads.append(transfer)
        for req_id, blocks in (metadata.saves or {}).items():
            step.saves.extend(self._start(child, "save", req_id, blocks) for child in self._sync_savers)
        for req_id, savers in (metadata.async_saves or {}).items():
            for child in savers:
                if self._modes[child] == "finish":
                    self._open[(child, req_id, "save")] = self._start(child, "save", req_id, 0)
        for child, child_metadata in enumerate(metadata.per_child):
            if self._modes[child] == "jobs" and child_metadata is not None:
                self._start_jobs(child, child_metadata)
        return bool(step.loads or step.saves or self._open)

    @property
    def saves_open(self) -> bool:
        """True while the bound step has sync saves, which its ``wait_for_save`` completes."""
        return bool(self._step.saves)

    def saves_waited(self, aborted: bool) -> None:
        """The step's ``wait_for_save`` returned: its sync saves are done (``aborted``: a load of the step failed
        and the composite stopped its layer saves)."""
        saves, self._step.saves = self._step.saves, []
        end, failed = time_ns(), self._failed_children()
        blocks = _blocks_by_child(saves)
        for transfer in saves:
            outcome: Outcome = "aborted" if aborted else "failed" if failed[transfer.child] else "ok"
            self._end(transfer, end, outcome, self._calls_copy(transfer, blocks))

    def load_errors(self, blocks: set[int]) -> None:
        self._load_error_blocks |= blocks

    def end_sync_loads(self) -> None:
        """The step's sync loads end, at their child's last load wait, once the blocks that failed to load are
        known (vLLM asks for them after the forward pass)."""
        loads, self._step.loads = self._step.loads, []
        blocks = _blocks_by_child(loads)
        for transfer in loads:
            outcome: Outcome = "ok" if self._load_error_blocks.isdisjoint(transfer.block_ids) else "failed"
            end = self.waits.load_end_ns[transfer.child] or time_ns()
            self._end(transfer, end, outcome, self._calls_copy(transfer, blocks))

    def end_step(self) -> None:
        """The step's metadata is cleared: what it moved synchronously has ended."""
        self.end_sync_loads()
        if self._step.saves:  # the step had no wait_for_save
            self.saves_waited(aborted=True)
        if self._awaiting_copy:  # the child sent no stats this step
            self._end_awaiting(None)
        self._step, self._load_error_blocks = _Step(), set()
        self._summaries.clear()  # the step's worker metadata, which takes them, has been built
        if self._open:
            self._expire()

    # ---- completions reported by children ----

    def child_failed(self, child: int) -> None:
        """The child raised instead of reporting its transfer results: every transfer it owes failed, with the
        error its guard recorded."""
        self._end_all_of(child, "failed", self._guards[child].last_error_type)

    def results(self, child: int, results: KVConnectorTransferResults, finished_req_ids: set[str]) -> None:
        """One child's transfer results."""
        end = time_ns()
        for req_id in results.finished_sending:
            if (transfer := self._open.pop((child, req_id, "save"), None)) is not None:
                self._end(transfer, end, "ok", None)
        for req_id in results.finished_recving:
            if (transfer := self._open.pop((child, req_id, "load"), None)) is not None:
                failed = req_id in results.failed_recving
                outcome: Outcome = "failed" if failed else "aborted" if transfer.aborted else "ok"
                if self._modes[child] == "finish" and outcome == "ok":
                    self._awaiting_copy.append((transfer, end))  # NIXL's telemetry comes with its stats, next
                else:
                    self._end(transfer, end, outcome, None)
        if finished_req_ids:  # finished by vLLM (aborted) while its loads run: they end when the child reports them
            for (owner, _, direction), transfer in self._open.items():
                if owner == child and direction == "load" and transfer.req_id in finished_req_ids:
                    transfer.aborted = True

    def child_stats(self, child: int, stats: Any) -> None:
        """A child's own stats of the step: NIXL's transfer telemetry gives the copy time of the loads it
        finished in this step."""
        if self._awaiting_copy and self._modes[child] == "finish":
            self._end_awaiting(nixl.copy_seconds(stats), child)

    def _end_awaiting(self, measured: float | None, child: int | None = None) -> None:
        """End the loads awaiting their copy time (``child``'s, or all), sharing ``measured`` among them."""
        ending = [(transfer, end) for transfer, end in self._awaiting_copy if child in (None, transfer.child)]
        self._awaiting_copy = [entry for entry in self._awaiting_copy if entry not in ending]
        together = _blocks_by_child([transfer for transfer, _ in ending])
        for transfer, end in ending:
            self._end(transfer, end, "ok", _share(measured, transfer, together[transfer.child]))

    def worker_meta(self, child: int, worker_meta: Any) -> None:
        """A ``jobs`` child's worker metadata: the jobs it completed, and the copy time its workers measured."""
        if self._modes[child] != "jobs" or worker_meta is None:
            return
        end = time_ns()
        done: dict[Direction, list[Transfer]] = {"load": [], "save": []}
        for job_id in offloading.completed_jobs(worker_meta):
            for direction in DIRECTIONS:
                if (transfer := self._open.pop((child, job_id, direction), None)) is not None:
                    done[direction].append(transfer)
        for direction, transfers in done.items():
            measured = offloading.copy_seconds(worker_meta, direction)
            together = _blocks_by_child(transfers)
            for transfer in transfers:
                outcome: Outcome = "aborted" if transfer.aborted else "ok"
                self._end(transfer, end, outcome, _share(measured, transfer, together[transfer.child]))

    def loads_given_back(self, req_ids: set[str]) -> None:
        """kvcompose reported these requests' async loads failed (their child failed): each of their open loads,
        a job's too (keyed by its job id), has ended. A job the child completes later is then no longer open."""
        end = time_ns()
        for key in [key for key, transfer in self._open.items() if key[2] == "load" and transfer.req_id in req_ids]:
            self._end(self._open.pop(key), end, "failed", None)

    def take_summaries(self) -> dict[str, dict[tuple[str, Direction], list[float]]]:
        """Per traced request whose transfers ended since the last call: (child, direction) -> [lifetime s,
        copy s, bytes]; for the request span's summary (see kvcompose.tracing.pipeline)."""
        summaries, self._summaries = self._summaries, {}
        return summaries

    def close(self) -> None:
        """Engine shutting down: what is still open ends as aborted."""
        for child in range(len(self._specs)):
            self._end_all_of(child, "aborted")

    def sizes(self) -> dict[str, int]:
        sizes = {"open_transfers": len(self._open), "traced_summaries": len(self._summaries),
                 "awaiting_copy": len(self._awaiting_copy)}
        return {name: size for name, size in sizes.items() if size}

    # ---- helpers ----

    def _start_jobs(self, child: int, child_metadata: Any) -> None:
        for job in offloading.jobs(child_metadata):
            self._open[(child, job.job_id, job.direction)] = self._start(child, job.direction, job.req_id, job.blocks)

    def _start(self, child: int, direction: Direction, req_id: str, blocks: int) -> Transfer:
        self._recorder.started(child, direction)
        return Transfer(child, direction, req_id, blocks, self._bound_at, self._contexts.get(req_id))

    def _calls_copy(self, transfer: Transfer, blocks: dict[int, tuple[int, int]]) -> tuple[float, CopySource] | None:
        """A sync transfer's copy time: its child's blocking calls of the step in its direction, shared among the
        step's transfers of that child by their blocks (``blocks``: per child, the step's transfers in that
        direction and their blocks)."""
        return self.waits.of(transfer.child, transfer.direction) * _part(transfer, blocks[transfer.child]), "calls"

    def _end(
        self, transfer: Transfer, end_ns: int, outcome: Outcome, copy: tuple[float, CopySource] | None,
        error_type: str = "",
    ) -> None:
        nbytes = transfer.blocks * self._block_bytes
        lifetime_s = max(0, end_ns - transfer.start_ns) / 1e9
        copy_s, source = copy if copy is not None else (None, None)
        context = transfer.context
        self._recorder.ended(transfer.child, transfer.direction, lifetime_s, copy_s, nbytes, outcome,
                             None if context is None else format(context.trace_id, "032x"))
        if context is None or self._tracer is None:
            return
        if outcome == "failed" and not error_type:
            failed = self._failed_children()
            error_type = self._guards[transfer.child].last_error_type if failed[transfer.child] else FAILED_TRANSFER
        self._tracer.transfer(context, self._specs[transfer.child], transfer.req_id, transfer.direction,
                              transfer.start_ns, end_ns, transfer.blocks, nbytes, outcome, copy_s, source,
                              error_type or None)
        line = self._summaries.setdefault(transfer.req_id, {}).setdefault(
            (self._specs[transfer.child].name, transfer.direction), [0.0, 0.0, 0.0])
        line[0] += lifetime_s
        line[1] += copy_s or 0.0
        line[2] += nbytes

    def _failed_children(self) -> list[bool]:
        """Per child: did it fail in this step (its guard counted a failure since the step was bound)?"""
        if not self._failures_at_bind:
            return [False] * len(self._guards)
        return [guard.failures != at_bind for guard, at_bind in zip(self._guards, self._failures_at_bind, strict=True)]

    def _end_all_of(self, child: int, outcome: Outcome, error_type: str = "") -> None:
        end = time_ns()
        for key in [key for key in self._open if key[0] == child]:
            self._end(self._open.pop(key), end, outcome, None, error_type)

    def _expire(self) -> None:
        now = time_ns()
        if now < self._next_expiry_check:
            return
        self._next_expiry_check = now + _EXPIRY_CHECK_NS
        expired = [key for key, transfer in self._open.items() if now - transfer.start_ns > _EXPIRY_NS]
        for key in expired:
            self._end(self._open.pop(key), now, "aborted", None)
        if expired:
            logger.warning("transfers expired without completing", transfers=len(expired), expiry_s=EXPIRY_S)


def _blocks_by_child(transfers: Sequence[Transfer]) -> dict[int, tuple[int, int]]:
    """Per child: how many of ``transfers`` are its, and their blocks."""
    totals: dict[int, tuple[int, int]] = {}
    for transfer in transfers:
        count, blocks = totals.get(transfer.child, (0, 0))
        totals[transfer.child] = (count + 1, blocks + transfer.blocks)
    return totals


def _part(transfer: Transfer, together: tuple[int, int]) -> float:
    """``transfer``'s share of what it was made with (``together``: how many transfers, and their blocks), by
    blocks (equal shares when none has blocks)."""
    count, blocks = together
    return transfer.blocks / blocks if blocks else 1 / count


def _share(measured: float | None, transfer: Transfer, together: tuple[int, int]) -> tuple[float, CopySource] | None:
    """``transfer``'s share of a copy time its child measured for the transfers ``together`` counts."""
    if measured is None:
        return None
    return measured * _part(transfer, together), "child"
