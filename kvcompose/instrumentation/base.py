"""What the composite tells its instrumentation, and how a child call is observed.

The composite (kvcompose.connectors.composite) forwards; when the pipeline
turns metrics or tracing on, it holds an :class:`Instrumentation` of its role
(:class:`~kvcompose.instrumentation.scheduler.SchedulerInstrumentation` or
:class:`~kvcompose.instrumentation.worker.WorkerInstrumentation`) and tells
it, through the hooks below, what happens: a request admitted, a step bound, a
save waited for. Every hook of both roles is declared here and does nothing,
so a composite asked an operation of the other role (as MultiConnector's own
tests do) forwards it like MultiConnector. This class also holds what both
roles share: the recorder of calls, the tracer, and :meth:`Instrumentation.observe`,
the wrapper of every child call that has something to record.

Every observed call is timed: its latency goes to the histogram of its child
and operation, the time of a blocking call counts as engine wait, and a call
about a traced request or step gets a span.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import time_ns
from typing import TYPE_CHECKING, Any

from kvcompose.instrumentation.transfers import StepWaits
from kvcompose.live import board
from kvcompose.metrics.recorder import PipelineRecorder
from kvcompose.metrics.transfers import TransferRecorder
from kvcompose.names import qualified_name
from kvcompose.operations import CircuitOpen, Failed, Granularity, LookupRound, Operation
from kvcompose.tracing.pipeline import CallSpan, PipelineTracer, SpanContextIds, pipeline_tracer
from kvcompose.wire.stats import CALLS_KEY, TELEMETRY_KEY, TRANSFERS_KEY
from kvcompose.wire.telemetry import LIVE_RUNNING_CALLS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvcompose.child_spec import ChildSpec
    from kvcompose.config import Pipeline
    from kvcompose.wire.metadata import KVComposeMetadata, KVComposeWorkerMetadata, Summaries


# The watchdog's report of a composite's calls seen running at consecutive looks: (child name, operation label or
# name) -> (seconds running, whether past watchdog_s: stuck).
RunningCalls = dict[tuple[str, str], tuple[float, bool]]


@dataclass(slots=True)
class StepParents:
    """Where the call spans of the worker's bound step go: the step's spans (empty: the step is not traced)."""

    spans: tuple[SpanContextIds, ...] = ()


@dataclass(frozen=True, slots=True)
class Observation:
    """What an observed call of one child and operation records, and where."""

    instrumentation: Instrumentation
    child: int
    child_name: str
    operation: Operation
    slot: int | None  # in the latency histogram; None: the operation is not timed
    waits: StepWaits | None  # where its time counts as engine wait; None: it does not
    wait_slot: int  # its place in ``waits.seconds``
    tracer: PipelineTracer | None  # where its spans go; None: not traced
    template: int  # of its spans

    def record(self, start_ns: int, end_ns: int) -> None:
        """The call ran from ``start_ns`` to ``end_ns``: its latency, and its engine wait."""
        seconds = (end_ns - start_ns) / 1e9
        if self.slot is not None:
            self.instrumentation.recorder.timed(self.slot, seconds)
        if (waits := self.waits) is not None:
            waits.seconds[self.wait_slot] += seconds
            if self.operation.blocking == "load":
                waits.load_end_ns[self.child] = end_ns


def timed(observation: Observation, call: Callable[..., Any]) -> Callable[..., Any]:
    """``call``, timed."""
    def timed_call(*args: Any, **kwargs: Any) -> Any:
        start = time_ns()
        try:
            result = call(*args, **kwargs)
        except CircuitOpen:  # a call the breaker skipped took none of the child's time
            raise
        except Exception:
            observation.record(start, time_ns())
            raise
        observation.record(start, time_ns())
        return result
    return timed_call


def traced_call(
    observation: Observation, call: Callable[..., Any], parents: tuple[SpanContextIds, ...], request_id: str | None,
    args: tuple[Any, ...], kwargs: dict[str, Any],
) -> Any:
    """Make ``call`` timed, with a span under each of ``parents`` (if any)."""
    tracer = observation.tracer
    span = tracer.start_call(parents, request_id, observation.child_name) if parents and tracer else None
    result = error = None
    start = time_ns()
    try:
        result = call(*args, **kwargs)
        return result
    except Exception as failure:
        error = failure
        raise
    finally:
        end = time_ns()
        if not isinstance(error, CircuitOpen):  # a call the breaker skipped took none of the child's time
            observation.record(start, end)
        if span is not None:
            observation.instrumentation.span_ended(observation, span, start, end, args, result, error)


def engine_id_of(vllm_config: VllmConfig) -> str:
    """The id the engine's processes publish their live values under (see kvcompose.live)."""
    transfer_config = vllm_config.kv_transfer_config
    return transfer_config.engine_id if transfer_config is not None and transfer_config.engine_id else "engine"


class Instrumentation:
    """The metrics and spans of one composite, and the hooks of both roles' composites (each does nothing here)."""

    def __init__(
        self, pipeline: Pipeline, specs: list[ChildSpec], role: str, engine_id: str, ship_dense: bool = False,
    ) -> None:
        metrics = pipeline.metrics
        self.pipeline = pipeline
        self.specs = specs
        names = [spec.name for spec in specs]
        self.recorder = PipelineRecorder(metrics.enabled, metrics.latency_buckets, names, per_layer=metrics.per_layer,
                                         ship_dense=ship_dense)
        self.transfer_recorder = TransferRecorder(metrics.enabled, names, metrics.transfer_buckets)
        self.role, self.engine_id = role, engine_id
        self.tracer: PipelineTracer | None = pipeline_tracer(pipeline, role, engine_id)
        self.step_parents = StepParents()  # set per step by the worker
        self.step_saves = False  # worker: the bound step has sync saves, so wait_for_save is told
        self._reports_span_telemetry = metrics.enabled and self.tracer is not None

    # ---- the composite's calls into its children ----

    def traces(self, operation: Operation) -> bool:
        """Are this operation's calls traced at the pipeline's granularity (when their request or step is)?"""
        return self.tracer is not None and operation.traced and (
            operation.granularity is not Granularity.LAYER or self.tracer.granularity == "layer")

    def waits_on(self, operation: Operation) -> StepWaits | None:
        """Where the time of this operation's calls counts as engine wait (None: it does not)."""
        return None

    def observe(self, child: ChildSpec, operation: Operation, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call``, timed and traced under its request or step; ``call`` itself where there is nothing to
        record (an operation neither timed, nor engine wait, nor traced)."""
        label = self.recorder.label(operation)
        slot = self.recorder.slot(child.index, label) if label is not None else None
        waits = self.waits_on(operation)
        tracer = self.tracer if self.traces(operation) else None
        if slot is None and waits is None and tracer is None:
            return call
        observation = Observation(
            self, child.index, child.name, operation, slot, waits,
            StepWaits.slot(child.index, operation.blocking) if operation.blocking else -1,
            tracer, tracer.call_template(child, operation) if tracer is not None else -1)
        if tracer is None:
            return timed(observation, call)
        if operation.granularity is Granularity.REQUEST:
            def traced_about_request(*args: Any, **kwargs: Any) -> Any:
                context = tracer.request_context(args[0])
                return traced_call(observation, call, () if context is None else (context,), args[0].request_id,
                                   args, kwargs)
            return traced_about_request
        step = self.step_parents

        def traced_in_step(*args: Any, **kwargs: Any) -> Any:
            return traced_call(observation, call, step.spans, None, args, kwargs)
        return traced_in_step

    def span_ended(
        self, observation: Observation, span: CallSpan, start_ns: int, end_ns: int, args: tuple[Any, ...],
        result: Any, error: Exception | None,
    ) -> None:
        """A traced call ended: its span is recorded if it failed, is slow, or is always traced (see
        :class:`~kvcompose.tracing.pipeline.PipelineTracer`)."""
        tracer, operation = observation.tracer, observation.operation
        assert tracer is not None
        values = None
        if error is None and operation.describe is not None:
            try:
                values = operation.describe(args, result)
            except Exception:  # a result of a shape the child should not return: described by nothing
                values = None
        slow = end_ns - start_ns > tracer.slow_call_ns
        if values is not None and operation.settles is not None:  # a lookup answered (or deferred)
            tracer.end_lookup(span, observation.template, start_ns, end_ns, values, observation.child,
                              operation.settles(result), slow)
            return
        record = error is not None or operation.always_traced or tracer.granularity != "request" or slow
        tracer.end_call(span, observation.template, start_ns, end_ns, values,
                        None if error is None else qualified_name(type(error)), record)

    def calls_running(self, running: RunningCalls) -> None:
        """The watchdog's report of this composite's calls into children running long (it reads them while the
        engine's thread is stuck in one): published on the engine's live board for the front-end's gauges."""
        board(self.engine_id).set(f"{LIVE_RUNNING_CALLS}.{self.role}",
                                  [[child, op, round(seconds, 3), stuck] for (child, op), (seconds, stuck)
                                   in running.items()])

    # ---- failures ----

    def failed(self, child_name: str, operation: Operation, error: Exception) -> None:
        """A child call raised (told by the child's guard)."""
        self.recorder.count_error(child_name, operation, error)

    def breaker_changed(self, child_name: str, state: str) -> None:
        if self.tracer is not None:
            self.tracer.breaker_changed(child_name, state)

    # ---- scheduler hooks ----

    def admitted(self, request: Request, num_external_tokens: int, lookup_round: LookupRound | None,
                 loading: int | None, local_tokens: int = 0) -> None:
        """vLLM allocated the request's blocks (``update_state_after_alloc`` returned); ``lookup_round``: its last
        lookup round's answers, one per loader (None: no child was asked); ``loading``: the child that loads it;
        ``local_tokens``: the GPU prefix cache's hit when it was looked up."""

    def request_finished(self, request: Request, saves_async: bool) -> None:
        """vLLM finished the request (every child was told)."""

    def receipt(self, request: Request) -> dict[str, Any] | None:
        """The receipt of the request just finished (:meth:`request_finished`), for its kv_transfer_params; None:
        none (receipts off)."""
        return None

    def blocks_failed(self, block_ids: set[int]) -> None:
        """vLLM's invalid blocks of a step (``KVConnectorOutput.invalid_block_ids``): failed loads, to recompute."""

    def metadata_built(self, scheduler_output: SchedulerOutput, metadata: KVComposeMetadata) -> None:
        """A step's metadata is built: add what the workers need."""

    def worker_output(self, worker_metadata: KVComposeWorkerMetadata | None) -> None:
        """What the workers' metadata of a step reports."""

    # ---- worker hooks ----

    def step_bound(self, metadata: KVComposeMetadata) -> None:
        """The step's metadata is about to be bound."""

    def step_cleared(self) -> None:
        """The step's metadata was cleared."""

    def saves_waited(self, layer_saves: bool) -> None:
        """The step's ``wait_for_save`` returned, in a step with sync saves (:attr:`step_saves`)."""

    def transfer_results(
        self, answers: Sequence[KVConnectorTransferResults | Failed], finished_req_ids: set[str],
        settled: KVConnectorTransferResults,
    ) -> None:
        """Every child's transfer results (FAILED: it raised, and gives up what it owes), and the composite's."""

    def load_errors(self, child: int, blocks: set[int]) -> None:
        """A child reported blocks it failed to load."""

    def loads_given_back(self, blocks_by_child: dict[int, set[int]]) -> None:
        """The composite gave a failed child's loads back to vLLM."""

    def child_stats(self, child: int, stats: Any) -> None:
        """A child's own stats, taken with the composite's (the worker reads NIXL's transfer telemetry)."""

    def worker_meta_built(self, per_child: Sequence[Any]) -> Summaries | None:
        """The children's worker metadata of the step; returns the summaries of traced requests' transfers that
        ended, for the scheduler."""
        return None

    # ---- stats, state, shutdown ----

    def reports(self, idle: bool) -> dict[str, Any]:
        """The role's own reports for this take of the stats, by stats key (tier economics). ``idle``: the
        engine is going idle, so this is the last take for a while: report what changed now."""
        return {}

    def take_due(self) -> tuple[bool, bool]:
        """At this take of the stats: do kvcompose's tables go out (the scheduler side decides when: see
        :data:`kvcompose.instrumentation.scheduler.TABLES_EVERY_S`), and is the engine going idle (so the roles'
        reports report what changed now)?"""
        return True, False

    def take_tables(self) -> dict[str, Any] | None:
        """kvcompose's own tables since the last take that sent them (calls, transfers, span telemetry, the role's
        reports); None if this take sends none, or all are empty."""
        due, idle = self.take_due()
        if not due:
            return None
        tables: dict[str, Any] = {}
        if (calls := self.recorder.take()) is not None:
            tables[CALLS_KEY] = calls
        if (transfers := self.transfer_recorder.take()) is not None:
            tables[TRANSFERS_KEY] = transfers
        tables.update(self.reports(idle))
        if self._reports_span_telemetry:
            assert self.tracer is not None
            if (telemetry := self.tracer.telemetry()) is not None:
                tables[TELEMETRY_KEY] = telemetry
        return tables or None

    def sizes(self) -> dict[str, int]:
        """Sizes of the per-request state kept here that is not empty."""
        if self.tracer is not None and self.tracer.open_requests:
            return {"traced_requests": self.tracer.open_requests}
        return {}

    def close(self) -> None:
        """The engine shuts down: the tracer exports what it holds."""
        if self.tracer is not None:
            self.tracer.close()
