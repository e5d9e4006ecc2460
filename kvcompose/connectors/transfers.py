"""Transfers: one request, one child, one direction, from the step that issues it to its completion.

A child call returns long before an asynchronous child's copy is done, so
transfers are tracked apart from calls, on the worker, by how each kind of
child reports completion:

- **sync** (ExampleConnector, most storage connectors): a load completes at
  the end of the step's load wait (the last ``wait_for_layer_load``, which for
  layer-wise loaders overlaps the forward pass); a save of a request in its
  first step completes when that step's ``wait_for_save`` returns.
- **async loads** (any child that answered ``load_async``): from the step that
  issues the load until ``get_transfer_results`` names the request.
- **finish** (NIXL): the send to a decode server is a save from the request's
  end until the child reports it in ``finished_sending``.
- **jobs** (vLLM's OffloadingConnector): each load or store job its metadata
  issues, until the job appears in its worker metadata's ``completed_jobs``
  (the scheduler names those jobs' requests among the step's traced requests).

A transfer ends ``failed`` when its child failed in that step or reported
the load failed (a sync load: when one of its blocks was reported failed, by
its child or by kvcompose giving a failed child's loads back to vLLM; a
loader that fails in a save leaves its finished loads done), and ``aborted``
when vLLM finished its request first or it outlived :data:`EXPIRY_S`. Each
ended transfer is one ``kvcompose.transfer`` span (traced requests) and one
observation of the transfer metrics. With tensor parallelism only the first
worker tracks, and bytes count every worker's shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter, ne
from time import time_ns
from typing import TYPE_CHECKING, Any, Literal

from kvcompose.logs import get_logger
from kvcompose.tracing.pipeline import qualified_name

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvcompose.connectors.children import ChildSpec
    from kvcompose.connectors.isolation import ChildGuard
    from kvcompose.connectors.metadata import KVComposeMetadata, LoadPlan
    from kvcompose.metrics.transfers import TransferRecorder
    from kvcompose.tracing.pipeline import NoTracing, PipelineTracer, SpanContextIds

logger = get_logger("transfers")

Mode = Literal["sync", "finish", "jobs"]
EXPIRY_S = 600.0  # an open transfer older than this ends as aborted
FAILED_TRANSFER = "kvcompose.transfer_failed"  # error.type of a failure the child reported without raising
_EXPIRY_NS = int(EXPIRY_S * 1e9)
_EXPIRY_CHECK_NS = 1_000_000_000
_FAILURES = attrgetter("failures")  # of a child's guard: the failures it counted so far

# How a child reports completion, by its class (or a base class) name.
_MODES: dict[str, Mode] = {
    "OffloadingConnector": "jobs",
    "NixlBaseConnector": "finish",  # vLLM 0.32-0.33: "NixlConnector" resolves to NixlPullConnector, a subclass
    "NixlConnector": "finish",  # vLLM 0.30-0.31
}


def completion_mode(connector_cls: type) -> Mode:
    for cls in connector_cls.__mro__:
        if (mode := _MODES.get(cls.__name__)) is not None:
            return mode
    return "sync"


def _jobs(child_metadata: Any) -> Iterable[tuple[Literal["load", "save"], Any, Any]]:
    """(direction, job id, job) of each job in a ``jobs`` child's metadata. Read by attribute name from
    vLLM's experimental offloading metadata: fields a release lacks yield nothing rather than fail."""
    for direction, field in (("load", "load_jobs"), ("save", "store_jobs")):
        jobs = getattr(child_metadata, field, None)
        if isinstance(jobs, Mapping):
            for job_id, job in jobs.items():
                yield direction, job_id, job


def job_requests(children_metadata: Iterable[Any]) -> set[str]:
    """Scheduler side: the requests whose jobs the metadata of ``jobs`` children issues this step."""
    return {req_id for metadata in children_metadata for _, _, job in _jobs(metadata)
            if isinstance(req_id := getattr(job, "req_id", None), str)}


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
class _Transfer:
    child: int
    direction: Literal["load", "save"]
    req_id: str
    blocks: int
    start_ns: int
    context: SpanContextIds | None
    aborted: bool = False


class TransferTracker:
    """The transfers of one worker-side composite; see the module docstring."""

    def __init__(
        self, specs: Sequence[ChildSpec], guards: Sequence[ChildGuard], block_bytes: int,
        recorder: TransferRecorder, tracer: PipelineTracer | NoTracing,
    ) -> None:
        self._specs = specs
        self._guards = guards
        self._modes = [completion_mode(spec.connector_cls) for spec in specs]
        self._job_children = [spec.index for spec in specs if self._modes[spec.index] == "jobs"]
        self._savers = [spec.index for spec in specs if spec.config.save and self._modes[spec.index] == "sync"]
        self._block_bytes = block_bytes
        self._recorder = recorder
        self._tracer = tracer
        # Sync loads of the bound step, loading child -> [loads, blocks]: they start at bind and end at the step's
        # last layer wait together, so they are recorded at once, per child and outcome. The step's planned loads
        # are read again one by one only where one may end otherwise than its child's others, or is traced.
        self._step_loads: dict[int, list[int]] = {}
        self._step_load_plans: Mapping[str, LoadPlan] = {}
        # Sync saves of the bound step, request id -> blocks (its metadata's ``saves``), by every sync saver: they
        # start at bind and end at the step's wait_for_save together, so each saver's are recorded at once.
        self._step_saves: Mapping[str, int] = {}
        self._load_end_ns = 0  # the step's last layer wait
        self._bound_at = 0  # when the step was bound (ns since the epoch)
        self._contexts: Mapping[str, SpanContextIds] = {}  # request id -> span context, of the bound step's traced
        self._failures_at_bind: list[int] = []
        self._load_error_blocks: set[int] = set()
        self._open: dict[tuple[int, str, str], _Transfer] = {}  # (child, request or job id, direction)
        self._next_expiry_check = 0

    # ---- the step ----

    def begin_step(self, metadata: KVComposeMetadata) -> bool:
        """Open the transfers the step's metadata issues; True if it has sync loads or saves (see
        :attr:`waits_for_loads`, :attr:`saves_open`)."""
        starts = metadata.loads or metadata.saves or metadata.async_saves or self._job_children
        # Whether a child failed in this step (its transfers then end failed, with the error it raised) is
        # read against these counts; open transfers need them too, in a step that starts nothing.
        self._failures_at_bind = [guard.failures for guard in self._guards] if starts or self._open else []
        if not starts:
            return False
        self._bound_at = time_ns()  # every transfer the step opens starts now
        self._contexts = self._tracer.step_contexts()
        step_loads = self._step_loads
        for req_id, plan in (metadata.loads or {}).items():
            child = plan.child
            if self._modes[child] == "jobs":
                continue  # its jobs say more, below
            if plan.load_async:
                self._open[(child, req_id, "load")] = self._start(child, "load", req_id, len(plan.block_ids))
            elif (totals := step_loads.get(child)) is None:  # told to the recorder once they end (_end_step_loads)
                step_loads[child] = [1, len(plan.block_ids)]
            else:
                totals[0] += 1
                totals[1] += len(plan.block_ids)
        if step_loads:
            self._step_load_plans = metadata.loads or {}
        if metadata.saves and self._savers:  # told to the recorder once they end (see _end_step_saves)
            self._step_saves = metadata.saves
        for req_id, savers in (metadata.async_saves or {}).items():
            for child in savers:
                if self._modes[child] == "finish":
                    self._open[(child, req_id, "save")] = self._start(child, "save", req_id, 0)
        for child in self._job_children:
            if (child_metadata := metadata.per_child[child]) is not None:
                self._start_jobs(child, child_metadata)
        return bool(self._step_loads or self._step_saves)

    @property
    def open(self) -> bool:
        """True while a transfer spans steps (async loads, sends, jobs)."""
        return bool(self._open)

    @property
    def saves_open(self) -> bool:
        """True when the step has sync saves, which its ``wait_for_save`` completes."""
        return bool(self._step_saves)

    @property
    def waits_for_loads(self) -> bool:
        """True when the step has sync loads, whose end :meth:`layer_waited` marks."""
        return bool(self._step_loads)

    def layer_waited(self, layer_name: str) -> None:
        self._load_end_ns = time_ns()

    def saves_waited(self) -> None:
        """The step's ``wait_for_save`` returned: its sync saves are done."""
        self._end_step_saves(time_ns(), aborted=False)

    def saves_skipped(self) -> None:
        """This step's sync saves will not complete (a load failed and the composite stopped the layer
        saves, or the step ended without a wait_for_save): they are aborted."""
        self._end_step_saves(time_ns(), aborted=True)

    def load_errors(self, blocks: set[int]) -> None:
        self._load_error_blocks |= blocks

    def end_step(self) -> None:
        if not (self._step_loads or self._step_saves or self._open):  # the step moved nothing tracked
            self._load_end_ns, self._load_error_blocks = 0, set()
            return
        if self._step_loads:
            self._end_step_loads(self._load_end_ns or time_ns())
        if self._step_saves:  # left open: the step had no wait_for_save
            self.saves_skipped()
        self._load_end_ns = 0
        self._load_error_blocks = set()
        if self._open:
            self._expire()

    # ---- completions reported by children ----

    def child_raised(self, child: int, error: Exception) -> None:
        """The child raised instead of reporting its transfer results: every transfer it owes failed, with
        that error (its guard counts the failure only after this)."""
        self._end_all_of(child, "failed", qualified_name(type(error)))

    def results(self, child: int, results: KVConnectorTransferResults, finished_req_ids: set[str]) -> None:
        """One child's transfer results."""
        end = time_ns()
        for req_id in results.finished_sending:
            if (transfer := self._open.pop((child, req_id, "save"), None)) is not None:
                self._end(transfer, end, "ok")
        for req_id in results.finished_recving:
            if (transfer := self._open.pop((child, req_id, "load"), None)) is not None:
                failed = req_id in results.failed_recving
                self._end(transfer, end, "failed" if failed else "aborted" if transfer.aborted else "ok")
        for req_id in finished_req_ids:  # finished by vLLM (aborted) while its load runs
            if (transfer := self._open.get((child, req_id, "load"))) is not None:
                transfer.aborted = True

    def worker_meta(self, child: int, worker_meta: Any) -> None:
        """A ``jobs`` child's worker metadata: the jobs it completed."""
        if self._modes[child] != "jobs" or worker_meta is None:
            return
        end = time_ns()
        for job_id in getattr(worker_meta, "completed_jobs", None) or ():
            for direction in ("load", "save"):
                if (transfer := self._open.pop((child, str(job_id), direction), None)) is not None:
                    self._end(transfer, end, "ok")

    def loads_given_back(self, req_ids: set[str]) -> None:
        """kvcompose reported these async loads failed (their child failed)."""
        end = time_ns()
        for key in [key for key in self._open if key[1] in req_ids and key[2] == "load"]:
            self._end(self._open.pop(key), end, "failed")

    def close(self) -> None:
        """Engine shutting down: what is still open ends as aborted."""
        for child in range(len(self._specs)):
            self._end_all_of(child, "aborted")

    def sizes(self) -> dict[str, int]:
        sizes = {"open_transfers": len(self._open),
                 "step_transfers": sum(loads for loads, _ in self._step_loads.values())
                 + len(self._step_saves) * len(self._savers)}
        return {name: size for name, size in sizes.items() if size}

    # ---- helpers ----

    def _start_jobs(self, child: int, child_metadata: Any) -> None:
        for direction, job_id, job in _jobs(child_metadata):
            req_id = getattr(job, "req_id", None)
            if not isinstance(req_id, str):
                continue
            engine_side = getattr(job, "dst_spec" if direction == "load" else "src_spec", None)  # the engine's blocks
            block_ids = getattr(engine_side, "block_ids", None)  # a numpy array in vLLM 0.32: no truth value
            blocks = len(block_ids) if block_ids is not None else 0
            self._open[(child, str(job_id), direction)] = self._start(child, direction, req_id, blocks)

    def _start(self, child: int, direction: Literal["load", "save"], req_id: str, blocks: int) -> _Transfer:
        self._recorder.started(child, direction)
        context = self._contexts.get(req_id) if self._contexts else None  # traced requests of the step
        return _Transfer(child, direction, req_id, blocks, self._bound_at, context)

    def _end(
        self, transfer: _Transfer, end_ns: int, outcome: Literal["ok", "failed", "aborted"], error_type: str = "",
    ) -> None:
        nbytes = transfer.blocks * self._block_bytes
        seconds = (end_ns - transfer.start_ns) / 1e9 if end_ns > transfer.start_ns else 0.0
        context = transfer.context
        self._recorder.ended(transfer.child, transfer.direction, seconds, nbytes, outcome,
                             None if context is None else format(context.trace_id, "032x"))
        if context is not None:
            self._span(transfer.child, transfer.direction, transfer.req_id, transfer.blocks, context,
                       transfer.start_ns, end_ns, outcome, error_type)

    def _end_step_loads(self, end_ns: int) -> None:
        """The step's sync loads end, told to the recorder once per child and outcome. A load failed when one of
        its blocks was reported failed, as vLLM sees it: by its child, or by kvcompose giving the loads of a child
        that failed back to vLLM. (A loader that fails after its loads, in a save, leaves them done.)"""
        totals, self._step_loads = self._step_loads, {}
        plans, self._step_load_plans = self._step_load_plans, {}
        error_blocks, contexts = self._load_error_blocks, self._contexts
        start_ns = self._bound_at
        seconds = (end_ns - start_ns) / 1e9 if end_ns > start_ns else 0.0
        # (child, outcome) -> [loads, blocks, a traced one's trace id]
        ended: dict[tuple[int, Literal["ok", "failed"]], list[Any]] = {}
        if not (error_blocks or contexts):  # every load done: each child's totals say it all
            for child, (count, blocks) in totals.items():
                ended[(child, "ok")] = [count, blocks, None]
        else:  # load by load: one with a block reported failed fails alone, and a traced one is a span
            for req_id, plan in plans.items():
                child, block_ids = plan.child, plan.block_ids
                if plan.load_async or self._modes[child] == "jobs":
                    continue  # not a sync load: begin_step opened it, or its jobs did
                outcome: Literal["ok", "failed"] = "ok" if error_blocks.isdisjoint(block_ids) else "failed"
                if (group := ended.get((child, outcome))) is None:
                    group = ended[(child, outcome)] = [0, 0, None]
                group[0] += 1
                group[1] += len(block_ids)
                if (context := contexts.get(req_id)) is not None:
                    group[2] = context.trace_id
                    self._span(child, "load", req_id, len(block_ids), context, start_ns, end_ns, outcome)
        for (child, outcome), (count, blocks, trace_id) in ended.items():
            self._recorder.ended(child, "load", seconds, blocks * self._block_bytes, outcome,
                                 None if trace_id is None else format(trace_id, "032x"), count,
                                 started_together=True)

    def _end_step_saves(self, end_ns: int, aborted: bool) -> None:
        """The step's sync saves end, each saver's at once (``aborted``, or done: failed where the saver
        failed this step)."""
        saves, self._step_saves = self._step_saves, {}
        if not saves:
            return
        failed = [] if aborted else self._failed_children()
        start_ns = self._bound_at
        seconds = (end_ns - start_ns) / 1e9 if end_ns > start_ns else 0.0
        nbytes = sum(saves.values()) * self._block_bytes
        contexts = self._contexts  # the step's traced requests
        traced = [(req_id, blocks, context) for req_id, blocks in saves.items()
                  if (context := contexts.get(req_id)) is not None] if contexts else []
        exemplar = format(traced[-1][2].trace_id, "032x") if traced else None
        for child in self._savers:
            outcome: Literal["ok", "failed", "aborted"] = "aborted" if aborted else "failed" if failed[child] else "ok"
            self._recorder.ended(child, "save", seconds, nbytes, outcome, exemplar, len(saves),
                                 started_together=True)
            for req_id, blocks, context in traced:
                self._span(child, "save", req_id, blocks, context, start_ns, end_ns, outcome)

    def _span(
        self, child: int, direction: Literal["load", "save"], req_id: str, blocks: int, context: SpanContextIds,
        start_ns: int, end_ns: int, outcome: Literal["ok", "failed", "aborted"], error_type: str = "",
    ) -> None:
        """A traced transfer's ``kvcompose.transfer`` span."""
        if outcome == "failed" and not error_type:
            error_type = self._guards[child].last_error_type if self._failed_children()[child] else FAILED_TRANSFER
        self._tracer.transfer(context, self._specs[child], req_id, direction, start_ns, end_ns, blocks,
                              blocks * self._block_bytes, outcome, error_type or None)

    def _failed_children(self) -> list[bool]:
        """Per child: did it fail in this step (its guard counted a failure since the step was bound)?"""
        if not (at_bind := self._failures_at_bind):
            return [False] * len(self._guards)
        return list(map(ne, map(_FAILURES, self._guards), at_bind))  # each guard's count now != at bind

    def _end_all_of(self, child: int, outcome: Literal["ok", "failed", "aborted"], error_type: str = "") -> None:
        end = time_ns()
        for key in [key for key in self._open if key[0] == child]:
            self._end(self._open.pop(key), end, outcome, error_type)

    def _expire(self) -> None:
        now = time_ns()
        if now < self._next_expiry_check:
            return
        self._next_expiry_check = now + _EXPIRY_CHECK_NS
        expired = [key for key, transfer in self._open.items() if now - transfer.start_ns > _EXPIRY_NS]
        for key in expired:
            self._end(self._open.pop(key), now, "aborted")
        if expired:
            logger.warning("transfers expired without completing", transfers=len(expired), expiry_s=EXPIRY_S)
