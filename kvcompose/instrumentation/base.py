"""What the composite tells its instrumentation, and how a child call is observed.

The composite (kvcompose.connectors.composite) forwards; when the pipeline
turns metrics or tracing on, it holds an :class:`Instrumentation` of its role
(:class:`~kvcompose.instrumentation.scheduler.SchedulerInstrumentation` or
:class:`~kvcompose.instrumentation.worker.WorkerInstrumentation`) and tells
it, through the hooks below, what happens: a request admitted, a step bound, a
save waited for. This class holds what both roles share: the recorder of
calls, the tracer, and :meth:`Instrumentation.observe`, the wrapper every
child call has in its observed form (see kvcompose.connectors.calls).

An observed call is timed, and what its time means is read from its
operation's :class:`CallState`, which the role sets before the call: the
calls it stands for in the latency histogram (its weight: see
kvcompose.instrumentation.sampling), whether its time is engine wait, and the
spans it belongs under. A call with nothing to record is made as is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from time import time_ns
from typing import TYPE_CHECKING, Any

from kvcompose.connectors.isolation import CircuitOpen
from kvcompose.instrumentation.transfers import StepWaits
from kvcompose.metrics.recorder import PipelineRecorder
from kvcompose.metrics.stats import CALLS_KEY, TELEMETRY_KEY, TRANSFERS_KEY
from kvcompose.live import board
from kvcompose.metrics.telemetry import LIVE_RUNNING_CALLS
from kvcompose.metrics.transfers import TransferRecorder
from kvcompose.operations import CHILD_OPERATIONS, OPERATIONS, Granularity, Operation
from kvcompose.tracing.attributes import qualified_name
from kvcompose.tracing.pipeline import CallSpan, PipelineTracer, SpanContextIds, pipeline_tracer

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvcompose.config import Pipeline
    from kvcompose.instrumentation.watchdog import RunningCalls
    from kvcompose.connectors.calls import ChildCalls
    from kvcompose.connectors.children import Child, ChildSpec

# The exporter's counters (spans dropped, spans waiting) are read at most this often, not every step.
TELEMETRY_EVERY_S = 0.5


@dataclass(slots=True)
class CallState:
    """How calls are observed now: per operation on the scheduler (set per call), one for every operation on
    the worker (set per step)."""

    weight: int = 0  # calls the current call stands for in the latency histogram; 0: not recorded there
    sampled: int = 0  # its weight comes from a sampler: the number of that sample (a call, or a step); 0: not
    parents: tuple[SpanContextIds, ...] = ()  # worker: where the bound step's call spans go


@dataclass(slots=True)
class _Sampled:
    """The calls of one operation in its latest sample, per child: the calls not timed count at their latency."""

    sample: int = 0
    seconds: dict[int, float] = field(default_factory=dict)  # child index -> latency of its last call
    calls: dict[int, int] = field(default_factory=dict)  # child index -> its calls in the sample


@dataclass(frozen=True, slots=True)
class Observation:
    """What an observed call of one child and operation records, and where."""

    instrumentation: Instrumentation
    child: int
    child_name: str
    operation: Operation
    state: CallState
    slot: int | None  # in the latency histogram; None: the operation is not timed
    waits: StepWaits | None  # where its time counts as engine wait; None: it does not
    wait_slot: int  # its place in ``waits.seconds``
    tracer: PipelineTracer | None  # where its spans go; None: not traced
    template: int  # of its spans


def timed_call(
    observation: Observation, call: Callable[..., Any], parents: tuple[SpanContextIds, ...], request_id: str | None,
    args: tuple[Any, ...], kwargs: dict[str, Any],
) -> Any:
    """Make ``call`` timed, recording what its state asks for: its latency (with the calls it stands for), its
    engine wait, and a span under each of ``parents`` (if any). The watchdog knows a call kvcompose times by this
    function's frame on its stack."""
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
            state, seconds = observation.state, (end - start) / 1e9
            if observation.slot is not None and state.weight:
                observation.instrumentation.recorder.timed(observation.slot, seconds, state.weight)
                if state.sampled:
                    observation.instrumentation.note_sampled(observation, seconds)
            if (waits := observation.waits) is not None:
                waits.seconds[observation.wait_slot] += seconds
                if observation.operation.blocking == "load":
                    waits.load_end_ns[observation.child] = end
        if span is not None:
            observation.instrumentation.span_ended(observation, span, start, end, args, result, error)


def engine_id_of(vllm_config: VllmConfig) -> str:
    """The id the engine's processes publish their live values under (see kvcompose.live)."""
    transfer_config = vllm_config.kv_transfer_config
    return transfer_config.engine_id if transfer_config is not None and transfer_config.engine_id else "engine"


class Instrumentation:
    """The metrics and spans of one composite, and the hooks its role's composite calls."""

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
        self.states = {name: CallState() for name in CHILD_OPERATIONS}
        self._sampled = {name: _Sampled() for name in CHILD_OPERATIONS}
        self._slow_calls: list[tuple[int, Operation, float]] = []  # from the watchdog: (child, operation, seconds)
        self._samples = 0  # samples taken so far (see CallState.sampled)
        self._reports_span_telemetry = metrics.enabled and self.tracer is not None
        self._telemetry_due = 0  # monotonic ns when the exporter's counters are read next

    # ---- the composite's calls into its children ----

    def calls_for(self, child_calls: ChildCalls) -> Any:
        """What the composite reads its calls from (``self._calls``); see the roles."""
        return child_calls.plain

    def traces(self, operation: Operation) -> bool:
        """Are this operation's calls traced at the pipeline's granularity (when their request or step is)?"""
        return self.tracer is not None and operation.traced and (
            operation.granularity is not Granularity.LAYER or self.tracer.granularity == "layer")

    def state_of(self, operation: Operation) -> CallState:
        """The state the observed calls of ``operation`` read."""
        return self.states[operation.name]

    def waits_on(self, operation: Operation) -> StepWaits | None:
        """Where the time of this operation's calls counts as engine wait (None: it does not)."""
        return None

    def observe(self, child: Child, operation: Operation, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call``, timed whenever its state asks for it, and traced under its request or step."""
        label = self.recorder.label(operation)
        tracer = self.tracer if self.traces(operation) else None
        wait_slot = StepWaits.slot(child.index, operation.blocking) if operation.blocking else -1
        observation = Observation(
            self, child.index, child.name, operation, self.state_of(operation),
            self.recorder.slot(child.index, label) if label is not None else None, self.waits_on(operation),
            wait_slot, tracer, tracer.call_template(child.spec, operation) if tracer is not None else -1)
        state = observation.state
        about_request = tracer is not None and operation.granularity is Granularity.REQUEST

        def observed(*args: Any, **kwargs: Any) -> Any:
            request_id = None
            parents: tuple[SpanContextIds, ...] = ()
            if about_request:
                request_id = args[0].request_id
                if (context := tracer.request_context(args[0])) is not None:  # type: ignore[union-attr]
                    parents = (context,)
            elif tracer is not None:
                parents = state.parents
            if not (parents or state.weight):
                return call(*args, **kwargs)
            return timed_call(observation, call, parents, request_id, args, kwargs)

        return observed

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

    def next_sample(self) -> int:
        """The number of a new sample (a sampled call, or step)."""
        self._samples += 1
        return self._samples

    def note_sampled(self, observation: Observation, seconds: float) -> None:
        """A call of a sample took ``seconds``: what the calls not timed count at, at the next idle."""
        sampled = self._sampled[observation.operation.name]
        if sampled.sample != observation.state.sampled:
            sampled.sample, sampled.seconds, sampled.calls = observation.state.sampled, {}, {}
        sampled.seconds[observation.child] = seconds
        sampled.calls[observation.child] = sampled.calls.get(observation.child, 0) + 1

    def credit_untimed(self, operation: str, samples: int) -> None:
        """The engine went idle: ``samples`` units not timed (calls, or worker steps) of ``operation`` count as
        its latest sample's calls did."""
        label = self.recorder.label(OPERATIONS[operation])
        if not samples or label is None:
            return
        sampled = self._sampled[operation]
        for child, seconds in sampled.seconds.items():
            self.recorder.timed(self.recorder.slot(child, label), seconds, samples * sampled.calls[child])

    def slow_call(self, child: int, operation: Operation, seconds: float) -> None:
        """The watchdog saw a call that was not timed run ``seconds`` (any thread): it lands in the latency
        histogram on its own."""
        self._slow_calls.append((child, operation, seconds))

    def _record_slow_calls(self) -> None:
        """The watchdog's calls, recorded on the engine's thread (which owns the samplers)."""
        slow, self._slow_calls[:] = self._slow_calls[:], []
        for child, operation, seconds in slow:
            if (label := self.recorder.label(operation)) is not None:
                self.recorder.timed(self.recorder.slot(child, label), seconds, 1)
                self.uncount(operation)

    def uncount(self, operation: Operation) -> None:
        """A call counted by a sampler was recorded on its own after all."""

    def child_stats(self, child: int, stats: Any) -> None:
        """A child's own stats, taken with the composite's (the worker reads NIXL's transfer telemetry)."""

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

    # ---- stats, state, shutdown ----

    def reports(self, idle: bool) -> dict[str, Any]:
        """The role's own reports for this take of the stats, by stats key (tier economics). ``idle``: the
        engine is going idle, so this is the last take for a while: report what changed now."""
        return {}

    def flush_due(self) -> bool:
        """Whether this take of the stats credits the calls not timed (the engine goes idle)."""
        return False

    def flush(self) -> None:
        """Credit every operation's calls not timed since its last timed one (the engine goes idle)."""

    def take_tables(self) -> dict[str, Any] | None:
        """kvcompose's own tables since the last call (calls, transfers, span telemetry); None if all empty."""
        if self._slow_calls:
            self._record_slow_calls()
        if idle := self.flush_due():
            self.flush()
        tables: dict[str, Any] = {}
        if (calls := self.recorder.take()) is not None:
            tables[CALLS_KEY] = calls
        if (transfers := self.transfer_recorder.take()) is not None:
            tables[TRANSFERS_KEY] = transfers
        tables.update(self.reports(idle))
        # Span export's counters every TELEMETRY_EVERY_S, and as the engine goes idle: the last change before a
        # pause (an exporter restarted as traffic ended) is not left waiting for the next request.
        if self._reports_span_telemetry and ((now := time_ns()) >= self._telemetry_due or idle):
            self._telemetry_due = now + int(TELEMETRY_EVERY_S * 1e9)
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
