"""Metrics, tracing and transfer tracking around a composite, apart from its forwarding logic.

When a pipeline turns metrics or tracing on, :class:`Instrumentation` wraps the
composite's methods on the instance (vLLM calls ``connector.<method>(...)``, and
an instance attribute stands before the class's method) and adds to the
children's calls (:mod:`kvcompose.connectors.calls`) what it reads from them.
With both off there is no instrumentation, and the composite forwards at
MultiConnector's cost.

What the wrappers do:

- A timed operation (``Operation.label``) is counted down
  (:class:`~kvcompose.metrics.recorder.OperationSampler`): one call in
  ``metrics.sample_every`` runs the operation's *timed* calls.
- A call about a sampled request (scheduler side), and every traced call of a
  step that moves a sampled request's KV (worker side), runs the *traced*
  calls. It is counted down like any other call, and runs the timed and
  traced calls when it is the one to time. A traced step does not wrap
  anything: while it is bound, its traced operations rest on their traced
  calls (:meth:`~kvcompose.connectors.calls.ChildCalls.trace_by_default`).
- Scheduler side: an admitted request's lookup round is counted; a finished
  request's span ends; each step's metadata carries the sampled requests and
  the new requests' saves to the workers, and asks them to flush their stats
  when the step runs no forward pass. Its own stats are flushed then too, and
  whenever no admitted request is left.
- Worker side: around each step, the transfer tracker opens and ends transfers
  (:mod:`kvcompose.connectors.transfers`).

Taps on the children's calls read what only each child's result says:
transfer results and finished jobs for the tracker, blocks that failed to load
for the metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from time import monotonic
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvcompose.config import Pipeline
from kvcompose.connectors.calls import CallWrappers, ChildCalls, Fanout, Variant
from kvcompose.connectors.transfers import (
    TransferTracker,
    bytes_per_block,
    completion_mode,
    is_first_worker,
    job_requests,
)
from kvcompose.metrics.recorder import DENSE_FROM_WORKERS, OperationSampler, PipelineRecorder
from kvcompose.metrics.stats import CALLS_KEY, TELEMETRY_KEY, TRANSFERS_KEY
from kvcompose.metrics.telemetry import TelemetryCounters
from kvcompose.metrics.transfers import TransferRecorder
from kvcompose.operations import OPERATIONS, Granularity, Operation, Side
from kvcompose.tracing import PipelineTracer, pipeline_tracer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvcompose.connectors.children import Child, ChildSpec
    from kvcompose.connectors.composite import KVComposeConnector
    from kvcompose.connectors.ledger import SchedulerLedger
    from kvcompose.connectors.metadata import KVComposeMetadata

_TRANSFER_RESULTS, _WORKER_META = OPERATIONS["get_transfer_results"], OPERATIONS["build_connector_worker_meta"]
_LOAD_ERRORS = OPERATIONS["get_block_ids_with_load_errors"]
# The exporter's counters (spans dropped, spans waiting) are read at most this often, not every step.
TELEMETRY_EVERY_S = 0.5


class Instrumentation:
    """The metrics, spans and transfers of one composite; see the module docstring."""

    @classmethod
    def of(
        cls, pipeline: Pipeline, role: KVConnectorRole, specs: list[ChildSpec], vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
    ) -> Instrumentation | None:
        """The pipeline's instrumentation; None when it turns metrics and tracing off."""
        if not (pipeline.metrics.enabled or pipeline.tracing.enabled):
            return None
        return cls(pipeline, role, specs, vllm_config, kv_cache_config)

    def __init__(
        self, pipeline: Pipeline, role: KVConnectorRole, specs: list[ChildSpec], vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
    ) -> None:
        metrics, tracing = pipeline.metrics, pipeline.tracing
        names = [spec.name for spec in specs]
        self._side = Side.WORKER if role is KVConnectorRole.WORKER else Side.SCHEDULER
        worker = self._side is Side.WORKER
        self.recorder = PipelineRecorder(
            metrics.enabled, metrics.latency_buckets, names, per_layer=metrics.per_layer,
            ship_dense=worker and vllm_config.parallel_config.world_size >= DENSE_FROM_WORKERS,
            sample_every=metrics.sample_every,
        )
        self.tracer = pipeline_tracer(pipeline, role.name.lower())
        # The tracer again where tracing is on (None: off), so that a step with tracing off makes no call to it.
        self._active_tracer = self.tracer if isinstance(self.tracer, PipelineTracer) else None
        self._layer_spans = tracing.granularity == "layer"
        self._transfer_recorder = TransferRecorder(metrics.enabled, names, metrics.transfer_buckets)
        self._specs = specs
        # With tensor parallelism the first worker tracks transfers (bytes count every worker's shard).
        self._tracks_transfers = worker and is_first_worker()
        self._block_bytes = bytes_per_block(kv_cache_config, vllm_config.parallel_config.tensor_parallel_size)
        self._transfers: TransferTracker | None = None  # made when attached (it reads the children's guards)
        self._reports_span_telemetry = metrics.enabled and tracing.enabled
        self._reported_queued = 0
        self._telemetry_due = 0.0  # monotonic time the exporter's counters are next read
        # Scheduler side: children whose transfers are jobs in their metadata (their requests join the step's trace).
        self._job_children = [spec.index for spec in specs
                              if tracing.enabled and completion_mode(spec.connector_cls) == "jobs"]
        self._admitted: set[str] = set()  # scheduler side: admitted requests not finished yet
        self._step = 0  # worker side: the bound step's number (load errors are counted by it)
        self._flush_at_take = False  # the next stats are flushed (a step without a forward pass)
        self._composite: KVComposeConnector | None = None
        self._calls: ChildCalls | None = None
        self._ledger: SchedulerLedger | None = None
        self._forwards: dict[str, Callable[..., Any]] = {}  # method -> the composite's own, bound
        self._chosen_forwards: set[str] = set()  # ... those the composite chose on its instance
        self._installed: set[str] = set()  # methods this instrumentation set on the composite's instance
        self._wait_for_save: Callable[[], None] | None = None  # worker: what vLLM calls, but in a step with sync saves
        self._completing_saves_of_step = False  # worker: the bound step's wait_for_save completes its sync saves
        self._marking_layer_loads = False  # worker: the bound step's layer waits mark its sync loads' end
        self._step_traces: frozenset[str] = frozenset()  # worker: the operations a traced step traces
        self._step_traced = False  # worker: the bound step is traced

    # ---- the children's calls ----

    def call_wrappers(self) -> CallWrappers:
        """What the children's calls get: the recorder's timer and the tracer's span, in the timed and
        traced variants; the taps, in every variant."""
        recorder, tracer = self.recorder, self._active_tracer

        def timed(child: Child, operation: Operation, call: Callable[..., Any]) -> Callable[..., Any]:
            return recorder.timed(child.name, operation, call)

        def traced(child: Child, operation: Operation, call: Callable[..., Any]) -> Callable[..., Any]:
            assert tracer is not None
            return tracer.traced(child.spec, operation, call)

        return CallWrappers(timed=timed if recorder.enabled else None, traced=traced if tracer is not None else None,
                            tapped=self._tap)

    def _tap(self, child: Child, operation: Operation, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call``, with what the tracker or the metrics read from its result (or its failure)."""
        index, name = child.index, child.name
        if operation is _TRANSFER_RESULTS and self._tracks_transfers:

            def transfer_results(finished_req_ids: set[str]) -> Any:
                tracker = self._transfers  # made at attach, after the calls (read here: no call per child)
                assert tracker is not None
                try:
                    results = call(finished_req_ids)
                except Exception as error:
                    tracker.child_raised(index, error)  # it gives up what it owes
                    raise
                if results.finished_sending or results.finished_recving or (finished_req_ids and tracker.open):
                    tracker.results(index, results, finished_req_ids)
                return results

            return transfer_results
        if operation is _WORKER_META and self._tracks_transfers and completion_mode(child.spec.connector_cls) == "jobs":

            def worker_meta() -> Any:
                metadata = call()
                self._tracker().worker_meta(index, metadata)
                return metadata

            return worker_meta
        if operation is _LOAD_ERRORS and self.recorder.enabled:

            def load_errors() -> Any:
                blocks = call()
                if blocks:
                    self.recorder.count_load_errors(name, self._step, blocks)
                return blocks

            return load_errors
        return call

    def _tracker(self) -> TransferTracker:
        assert self._transfers is not None, "the tracker is made when the instrumentation is attached"
        return self._transfers

    def failed(self, child_name: str, operation: Operation, error: Exception) -> None:
        """A child call raised (told by the child's guard)."""
        self.recorder.count_error(child_name, operation, error)

    def breaker_changed(self, child_name: str, state: str) -> None:
        self.tracer.breaker_changed(child_name, state)

    def loads_given_back(self, blocks_by_child: Mapping[int, set[int]]) -> None:
        """The composite gave a failed child's loads back to vLLM: their blocks count as that child's load errors."""
        for index, blocks in blocks_by_child.items():
            self.recorder.count_load_errors(self._specs[index].name, self._step, blocks)

    # ---- the composite's methods ----

    def attach(self, composite: KVComposeConnector, calls: ChildCalls, ledger: SchedulerLedger) -> None:
        """Wrap ``composite``'s methods (on the instance) for this side of the engine."""
        self._composite, self._calls, self._ledger = composite, calls, ledger
        if self._tracks_transfers:
            self._transfers = TransferTracker(self._specs, [child.guard for child in calls.children],
                                              self._block_bytes, self._transfer_recorder, self.tracer)
        if self._side is Side.SCHEDULER:
            self._attach_scheduler()
        else:
            self._attach_worker()

    def _forwarded_here(self) -> Iterator[tuple[str, Operation, Callable[..., Any]]]:
        """(name, declaration, the composite's own bound method) of each forwarded operation of this side:
        its class's, or the one it chose for this pipeline (an instance attribute, set before attaching)."""
        composite = self._composite
        for name, operation in OPERATIONS.items():
            if operation.forwarded and operation.side in (self._side, Side.BOTH):
                forward = self._forwards[name] = getattr(composite, name)
                if getattr(forward, "__func__", None) is not getattr(type(composite), name):
                    self._chosen_forwards.add(name)
                yield name, operation, forward

    def _install(self, name: str, call: Callable[..., Any]) -> None:
        """vLLM's calls of the composite's method ``name`` go to ``call`` from now on. (Never through
        ``vars()``: a materialised instance ``__dict__`` makes every attribute read of the composite's own
        slower, in every call it forwards.)"""
        if call is self._forwards.get(name) and name not in self._chosen_forwards:
            if name in self._installed:
                delattr(self._composite, name)  # the class's own method again
                self._installed.discard(name)
        else:
            setattr(self._composite, name, call)
            self._installed.add(name)

    def _run_as(self, operation: Operation, choose: Callable[[], Fanout],
                forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` calling the operation's child calls of the variant ``choose`` picks, on each call,
        instead of the plain ones."""
        calls, name = self._calls, operation.name
        assert calls is not None
        current, resting = calls.current, calls.resting

        def run(*args: Any, **kwargs: Any) -> Any:
            setattr(current, name, getattr(choose(), name))
            try:
                return forward(*args, **kwargs)
            finally:  # the resting calls as they are made now: a breaker may have changed them meanwhile
                setattr(current, name, getattr(resting, name))

        return run

    def _counted_down(self, operation: Operation, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward``, one call in ``sample_every`` timed; ``forward`` itself if the operation is not timed."""
        sampler: OperationSampler | None = self.recorder.sampler(operation)
        if sampler is None:
            return forward
        assert self._calls is not None
        timing = self._calls.timing

        def sampled() -> Fanout:
            sampler.begin()
            return timing

        return sampler.around(forward, self._run_as(operation, sampled, forward))

    def _traced(self, operation: Operation, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` calling the traced child calls (scheduler side). A traced call is counted down like any
        other, and timed as well when it is the one its operation's sampler is due to time."""
        calls, sampler = self._calls, self.recorder.sampler(operation)
        assert calls is not None
        traced = calls.fanout(Variant.TRACED)
        if sampler is None:
            return self._run_as(operation, lambda: traced, forward)
        timed_traced = calls.fanout(Variant.TIMED | Variant.TRACED)

        def counted() -> Fanout:
            return timed_traced if sampler.count_traced() else traced

        return self._run_as(operation, counted, forward)

    # ---- scheduler side ----

    def _attach_scheduler(self) -> None:
        for name, operation, forward in self._forwarded_here():
            call = self._counted_down(operation, forward)
            if self._active_tracer is not None and operation.traced and operation.granularity is Granularity.REQUEST:
                call = self._traced_if_sampled(operation, forward, call)
            if name == "update_state_after_alloc":
                call = self._admitting(call)
            elif name in ("request_finished", "request_finished_all_groups"):
                call = self._finishing(call)
            elif name == "build_connector_meta":
                call = self._building_metadata(call)
            self._install(name, call)

    def _traced_if_sampled(self, operation: Operation, forward: Callable[..., Any],
                           untraced: Callable[..., Any]) -> Callable[..., Any]:
        """A call about a sampled request runs the traced calls; any other runs ``untraced``."""
        traced = self._traced(operation, forward)
        request_traced = self.tracer.request_traced  # type: ignore[union-attr]

        def call(*args: Any) -> Any:
            if request_traced(args[0]):
                return traced(*args)
            return untraced(*args)

        return call

    def _admitting(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """update_state_after_alloc: the request is admitted; its lookup round counts now, the first time only.
        vLLM calls it again for a request it admitted before: once an async load completes, and when a
        preempted request resumes."""
        recorder, ledger, admitted = self.recorder, self._ledger, self._admitted
        assert ledger is not None

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
            call(request, blocks, num_external_tokens)
            req_id = request.request_id
            if req_id in admitted:
                return
            admitted.add(req_id)
            if recorder.enabled and (looked_up := ledger.rounds.get(req_id)) is not None:
                answers = looked_up[3]
                assert answers is not None, "with metrics on, the composite keeps every answer of a lookup"
                recorder.request_admitted(answers, ledger.loaders, ledger.planned_loader(req_id),
                                          num_external_tokens)

        return update_state_after_alloc

    def _finishing(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """request_finished: the request's span ends, whatever the children answered. (Once no admitted
        request is left, the next stats are flushed: see :meth:`take_tables`.)"""
        tracer, admitted = self.tracer, self._admitted

        def request_finished(request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
            saves_async = False
            try:
                result = call(request, block_ids)
                saves_async = result[0]
                return result
            finally:
                tracer.request_finished(request, saves_async=saves_async)
                admitted.discard(request.request_id)

        return request_finished

    def _building_metadata(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """build_connector_meta: what the workers need to track transfers and join traces, and whether they
        flush their stats."""
        tracer, job_children = self._active_tracer, self._job_children

        def build_connector_meta(scheduler_output: Any) -> KVComposeMetadata:
            metadata = call(scheduler_output)
            if new_requests := scheduler_output.scheduled_new_reqs:
                metadata.saves = {new.req_id: len(new.block_ids[0]) if new.block_ids else 0 for new in new_requests}
            if tracer is not None:
                moving = job_requests(metadata.per_child[index] for index in job_children) if job_children else ()
                metadata.traced_requests = tracer.step_requests(scheduler_output, metadata.loads, moving)
            if not scheduler_output.total_num_scheduled_tokens:  # no forward pass: idle, or waiting
                metadata.flush_stats = self._flush_at_take = True
            return metadata

        return build_connector_meta

    # ---- worker side ----

    def _attach_worker(self) -> None:
        for name, operation, forward in self._forwarded_here():
            call = self._with_tracker(name, self._counted_down(operation, forward))
            if name == "wait_for_save":
                self._wait_for_save = call
            self._install(name, call)
        self._step_traces = frozenset(name for name, operation in OPERATIONS.items()
                                      if operation.forwarded and self._traced_in_steps(operation))
        self._install("bind_connector_metadata", self._binding(self._forwards["bind_connector_metadata"]))
        self._install("clear_connector_metadata", self._clearing(self._forwards["clear_connector_metadata"]))

    def _traced_in_steps(self, operation: Operation) -> bool:
        """Does a traced step call this operation's traced calls? (Per-layer ones only at layer granularity.)"""
        return self._active_tracer is not None and operation.traced and (
            operation.granularity is Granularity.STEP
            or (operation.granularity is Granularity.LAYER and self._layer_spans))

    def _with_tracker(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` with what the transfer tracker reads from the composite's answer, where it reads any."""
        if self._transfers is None:
            return call
        if name == "get_transfer_results":
            return self._giving_back(call)
        if name == "get_block_ids_with_load_errors":
            return self._noting_load_errors(call)
        return call

    def _binding(self, bind: Callable[..., Any]) -> Callable[..., Any]:
        def bind_connector_metadata(metadata: KVComposeMetadata) -> None:
            tracer = self._active_tracer
            traced = tracer is not None and tracer.begin_step(metadata.traced_requests, metadata.loads)
            transfers = self._transfers
            # after the tracer: its transfers join their requests' traces
            moves = transfers is not None and transfers.begin_step(metadata)
            self._step, self._flush_at_take = metadata.step, metadata.flush_stats
            bind(metadata)
            if traced:  # the step moves a sampled request's KV: its traced operations run their traced calls
                self._calls.trace_by_default(self._step_traces)  # type: ignore[union-attr]
                self._step_traced = True
            if moves:  # sync loads, whose end the layer waits mark, or sync saves, which wait_for_save completes
                assert transfers is not None
                if transfers.waits_for_loads:
                    self._calls.set_layer_load_marker(transfers.layer_waited)  # type: ignore[union-attr]
                    self._marking_layer_loads = True
                if transfers.saves_open:
                    self._install("wait_for_save", self._completing_saves())

        return bind_connector_metadata

    def _clearing(self, clear: Callable[..., Any]) -> Callable[..., Any]:
        def clear_connector_metadata() -> None:
            clear()
            if self._transfers is not None:
                self._transfers.end_step()
                if self._marking_layer_loads:
                    self._calls.set_layer_load_marker(None)  # type: ignore[union-attr]
                    self._marking_layer_loads = False
            if self._active_tracer is not None:
                self._active_tracer.end_step()
            if self._step_traced:  # back to the plain calls
                self._calls.trace_by_default(frozenset())  # type: ignore[union-attr]
                self._step_traced = False
            if self._completing_saves_of_step:  # the step had no wait_for_save
                self._stop_completing_saves()

        return clear_connector_metadata

    def _completing_saves(self) -> Callable[[], None]:
        """wait_for_save of a step with sync saves: once it returns, they are done (or, if the step's load
        failed and the composite stopped its layer saves, aborted). Once per step."""
        wait = self._wait_for_save
        assert wait is not None
        self._completing_saves_of_step = True

        def wait_for_save() -> None:
            try:
                wait()
            finally:
                self._stop_completing_saves()
                transfers, calls = self._tracker(), self._calls
                assert calls is not None
                if calls.layer_saves:
                    transfers.saves_waited()
                else:
                    transfers.saves_skipped()

        return wait_for_save

    def _stop_completing_saves(self) -> None:
        self._install("wait_for_save", self._wait_for_save)  # type: ignore[arg-type]
        self._completing_saves_of_step = False

    def _giving_back(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """get_transfer_results: async loads the composite reported failed end as failed transfers."""

        def get_transfer_results(finished_req_ids: set[str]) -> Any:
            results = call(finished_req_ids)
            if results.failed_recving:
                self._tracker().loads_given_back(results.failed_recving)
            return results

        return get_transfer_results

    def _noting_load_errors(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """get_block_ids_with_load_errors: the tracker fails the step's loads of those blocks."""

        def get_block_ids_with_load_errors() -> set[int]:
            blocks = call()
            if blocks:
                self._tracker().load_errors(blocks)
            return blocks

        return get_block_ids_with_load_errors

    # ---- stats, state, shutdown ----

    def take_tables(self) -> dict[str, Any] | None:
        """kvcompose's own tables since the last call (calls, transfers, span telemetry); None if all empty.
        Flushed when the step runs no forward pass, or (scheduler side) no admitted request is left."""
        if self._flush_at_take or (self._side is Side.SCHEDULER and not self._admitted):
            self._flush_at_take = False
            self.recorder.flush()
        tables: dict[str, Any] = {}
        if (calls := self.recorder.take()) is not None:
            tables[CALLS_KEY] = calls
        if self._transfers is not None and (transfers := self._transfer_recorder.take()) is not None:
            tables[TRANSFERS_KEY] = transfers
        if self._reports_span_telemetry and (now := monotonic()) >= self._telemetry_due:
            self._telemetry_due = now + TELEMETRY_EVERY_S
            if (telemetry := self._span_telemetry()) is not None:
                tables[TELEMETRY_KEY] = telemetry
        return tables or None

    def _span_telemetry(self) -> TelemetryCounters | None:
        """Spans this process dropped since the last report, and those waiting for export when that changed."""
        dropped, queued = self.tracer.telemetry()
        if not dropped and queued == self._reported_queued:
            return None
        self._reported_queued = queued
        return TelemetryCounters(dropped, queued)

    def sizes(self) -> dict[str, int]:
        """Sizes of the per-request state kept here that is not empty."""
        sizes = self._transfers.sizes() if self._transfers is not None else {}
        if self._admitted:
            sizes["admitted_requests"] = len(self._admitted)
        if self.tracer.open_requests:
            sizes["traced_requests"] = self.tracer.open_requests
        return sizes

    def close(self) -> None:
        """The engine shuts down: open transfers end as aborted; the tracer exports what it holds."""
        if self._transfers is not None:
            self._transfers.close()
        self.tracer.close()
