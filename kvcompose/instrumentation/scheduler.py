"""The scheduler side's instrumentation: requests admitted and finished, and what each step's metadata carries.

Hooks (the composite calls them):

- :meth:`admitted`: vLLM allocated a request's blocks. Its lookup round counts
  the first time only: vLLM allocates again for a request it admitted before
  (once an async load completes, when a preempted request resumes).
- :meth:`request_finished`: the request's span ends, whatever the children
  answered.
- :meth:`metadata_built`: each step's metadata carries the new requests' saves
  and the sampled requests to the workers, and tells them when to send their
  tables: once every :data:`TABLES_EVERY_S`, and at once when the step runs
  no forward pass (the engine goes idle). The scheduler's own tables go out at
  the same steps, and whenever no admitted request is left.
- :meth:`worker_output`: the transfer summaries the workers send back for
  traced requests.
"""

from __future__ import annotations

from time import monotonic_ns
from typing import TYPE_CHECKING, Any

from kvcompose.adapters.completion import completion_mode
from kvcompose.adapters.offloading import job_requests
from kvcompose.instrumentation.base import Instrumentation
from kvcompose.instrumentation.economics import StreamSampler
from kvcompose.instrumentation.receipts import Receipts
from kvcompose.instrumentation.tenants import TenantBooks
from kvcompose.operations import LookupRound
from kvcompose.wire.stats import ECONOMICS_KEY, TENANTS_KEY

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvcompose.child_spec import ChildSpec
    from kvcompose.config import Pipeline
    from kvcompose.wire.metadata import KVComposeMetadata, KVComposeWorkerMetadata


# kvcompose's own tables (calls, transfers, span telemetry, the roles' reports) go out in the engine's stats at
# most this often while it works, and at once as it goes idle. A take costs about the same whether it holds one
# step's calls or a second's, and so does the front-end's replay of it into Prometheus (scraped every 15 s or so):
# taken every step, the two were most of kvcompose's cost per step at small batches.
TABLES_EVERY_S = 1.0


class SchedulerInstrumentation(Instrumentation):
    """See the module docstring."""

    def __init__(
        self, pipeline: Pipeline, specs: list[ChildSpec], loaders: tuple[int, ...], engine_id: str,
        stream: StreamSampler | None, receipts: Receipts | None = None,
    ) -> None:
        super().__init__(pipeline, specs, "scheduler", engine_id)
        self.receipts = receipts  # the receipts' books and the router's predictions (None: neither is kept)
        self._loaders = loaders  # the loaders' indices, in the order of a lookup round's answers
        self._stream = stream if self.recorder.enabled else None  # the prefix-block stream, for tier economics
        # The books by tenant (None: metrics off, or tenants.top_k 0).
        self.tenants = (TenantBooks(pipeline.tenants, self._stream)
                        if self.recorder.enabled and pipeline.tenants.top_k else None)
        # Children whose transfers are jobs in their metadata (their requests join the step's trace).
        self._job_children = [spec.index for spec in specs
                              if self.tracer is not None and completion_mode(spec.connector_cls) == "jobs"]
        self._admitted: set[str] = set()  # admitted requests not finished yet
        self._tables_due_ns = 0  # monotonic ns from which the next step's stats carry the tables
        self._report_at_take = self._idle_at_take = False

    # ---- hooks ----

    def admitted(self, request: Request, num_external_tokens: int, lookup_round: LookupRound | None,
                 loading: int | None, local_tokens: int = 0) -> None:
        req_id = request.request_id
        if self.receipts is not None:
            self.receipts.admitted(request, num_external_tokens, local_tokens, loading)
        if self.tracer is not None:
            self.tracer.request_admitted(req_id)
        if req_id in self._admitted:
            return
        self._admitted.add(req_id)
        tenant = self.tenants.admitted(request) if self.tenants is not None else None
        if self._stream is not None:
            self._stream.admitted(request, tenant)
        if lookup_round is None:
            return
        self.recorder.request_admitted(lookup_round, self._loaders, loading, num_external_tokens)
        if tenant is not None and loading is not None:  # as the recorder counts loaded tokens
            self.tenants.loaded(tenant, self.specs[loading].name, num_external_tokens)
        if self.tracer is not None and loading is not None:
            self.tracer.request_loaded(req_id, self.specs[loading].name, num_external_tokens)

    def request_finished(self, request: Request, saves_async: bool) -> None:
        """vLLM finished the request (every child was told). Once no admitted request is left, the next stats
        are flushed."""
        if self.receipts is not None:  # first: the receipt reads the request's trace
            self.receipts.finished(request, self.tracer)
        if self.tracer is not None:
            self.tracer.request_finished(request, saves_async=saves_async)
        self._admitted.discard(request.request_id)

    def metadata_built(self, scheduler_output: SchedulerOutput, metadata: KVComposeMetadata) -> None:
        """Add what the workers need to track transfers and join traces, and whether they send their tables."""
        if new_requests := scheduler_output.scheduled_new_reqs:
            metadata.saves = {new.req_id: len(new.block_ids[0]) if new.block_ids else 0 for new in new_requests}
        if self.receipts is not None:
            if metadata.loads or metadata.cancelled_loads:
                self.receipts.planned(metadata)
            if scheduler_output.preempted_req_ids:
                self.receipts.preempted(scheduler_output.preempted_req_ids)
        if self.tracer is not None:
            moving = job_requests(metadata.per_child[index] for index in self._job_children)
            metadata.traced_requests = self.tracer.step_requests(scheduler_output, metadata.loads, moving)
        if not scheduler_output.total_num_scheduled_tokens:  # no forward pass: idle, or waiting
            metadata.flush_stats = metadata.report_stats = self._idle_at_take = True
        elif (now := monotonic_ns()) >= self._tables_due_ns:
            metadata.report_stats = self._report_at_take = True
            self._tables_due_ns = now + int(TABLES_EVERY_S * 1e9)
        # A request scheduled more than one token prefills them (decodes schedule one each).
        for tokens in scheduler_output.num_scheduled_tokens.values():
            if tokens > 1:
                metadata.prefill_tokens += tokens
            else:
                metadata.decode_tokens += tokens

    def worker_output(self, worker_metadata: KVComposeWorkerMetadata | None) -> None:
        """What the workers' metadata of a step reports: the transfers of traced requests that ended."""
        if self.tracer is not None and worker_metadata is not None and worker_metadata.summaries:
            self.tracer.add_summaries(worker_metadata.summaries)

    def close(self) -> None:
        super().close()
        if self._stream is not None:
            self._stream.close()

    def receipt(self, request: Request) -> dict[str, Any] | None:
        return self.receipts.receipt(request) if self.receipts is not None else None

    def blocks_failed(self, block_ids: set[int]) -> None:
        if self.receipts is not None:
            self.receipts.blocks_failed(block_ids)

    # ---- stats ----

    def reports(self, idle: bool) -> dict[str, Any]:
        reports = self.receipts.report() if self.receipts is not None and self.recorder.enabled else {}
        if self._stream is not None and (report := self._stream.report(now=idle)) is not None:
            reports[ECONOMICS_KEY] = report
        if self.tenants is not None and (tenants := self.tenants.report(now=idle)) is not None:
            reports[TENANTS_KEY] = tenants
        return reports

    def take_due(self) -> tuple[bool, bool]:
        idle = self._idle_at_take or not self._admitted
        due = self._report_at_take or idle
        self._report_at_take = self._idle_at_take = False
        return due, idle

    def sizes(self) -> dict[str, int]:
        sizes = super().sizes()
        if self.receipts is not None:
            sizes.update(self.receipts.sizes())
        if self._admitted:
            sizes["admitted_requests"] = len(self._admitted)
        return sizes
