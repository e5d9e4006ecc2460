"""The spans of one composite connector, at the pipeline's tracing granularity.

Scheduler side, every granularity: a ``kvcompose.request`` span per request
(the child of vLLM's request trace when the request carries a W3C
``traceparent``), and under it one span per per-request child call
(``kvcompose.lookup``, ``kvcompose.update_state_after_alloc``, ...).

Worker side, every granularity: ``kvcompose.load`` for each request a child
loads in a step and ``kvcompose.save`` for each request in its first step, per
saving child, and a ``kvcompose.transfer`` per transfer (see
:mod:`kvcompose.connectors.transfers`), all in the request's trace. The
scheduler sends each traced request's span context to the workers in the
composite's metadata (:class:`TracedRequest`).

``step`` adds a ``kvcompose.step`` span per worker step that moves KV for a
traced request (its first step, or a load), linked to each such request,
with the children's step calls under it; ``layer`` adds the per-layer calls.
Decode-only steps make no span. A step span exists only for traced requests,
so a sampled request keeps all its spans whatever the ratio.

Spans are :class:`SpanRecord` tuples here (ids and clock reads, no
OpenTelemetry objects), appended to the tracer's outbox, whose thread ships
them in batches (:mod:`kvcompose.tracing.outbox`). The
instrumentation (kvcompose.connectors.instrumentation) routes only the calls
of sampled requests and their steps through the traced calls this tracer
makes (:meth:`PipelineTracer.traced`): a request that is not sampled costs
one dict look-up per call of the composite.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from time import time_ns
from typing import TYPE_CHECKING, Any, NamedTuple

from kvcompose.config import Pipeline
from kvcompose.live import board
from kvcompose.logs import CURRENT_CALL
from kvcompose.metrics.telemetry import LIVE_SPANS_QUEUED, TelemetryCounters
from kvcompose.operations import Describe, Granularity, Operation
from kvcompose.tracing import attributes as attr
from kvcompose.tracing.records import IDS, parse_traceparent
from kvcompose.tracing.sampling import Sampling, sampling_for
from kvcompose.tracing.shipping import SpanShipper, shipper_for

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvcompose.connectors.children import ChildSpec
    from kvcompose.connectors.metadata import LoadPlan

class TracedRequest(NamedTuple):
    """A sampled request in a step, as the workers need it to join its trace."""

    request_id: str
    trace_id: int
    span_id: int  # of the request's span on the scheduler
    new: bool  # its first step: the prompt's KV is saved now


_UNSEEN = object()  # a request no child was asked about yet
# Breaker events that happen during a traced call, by the call's span id, until the call ends; shared by
# every tracer of the process, as is CURRENT_CALL. Almost always empty.
_CALL_EVENTS: dict[int, tuple[tuple[str, int, Mapping[str, Any]], ...]] = {}


class SpanContextIds(NamedTuple):
    trace_id: int
    span_id: int


@dataclass(slots=True)
class _RequestSpan:
    trace_id: int
    span_id: int
    parent_id: int
    start_ns: int


def qualified_name(error_type: type[BaseException]) -> str:
    """``error.type`` of a failure: the class's qualified name (the message may quote request data)."""
    if error_type.__module__ == "builtins":
        return error_type.__qualname__
    return f"{error_type.__module__}.{error_type.__qualname__}"


class PipelineTracer:
    """Records the spans of one composite; see the module docstring."""

    def __init__(self, shipper: SpanShipper, sampling: Sampling, pipeline: Pipeline, role: str) -> None:
        self._shipper = shipper
        self._sampling = sampling
        self._role = role
        self._step_spans = pipeline.tracing.granularity in ("step", "layer")
        self._layer_spans = pipeline.tracing.granularity == "layer"
        self._records = shipper.outbox()  # of plain SpanRecord tuples; its thread ships them
        templates = shipper.templates
        self._request_template = templates.register("kvcompose.request", {attr.PIPELINE: pipeline.name,
                                                                          attr.ROLE: role}, (attr.LOADED_BY,))
        self._step_template = templates.register("kvcompose.step", {attr.ROLE: role}, (attr.REQUESTS,))
        self._breaker_template = templates.register("kvcompose.circuit_breaker", {attr.ROLE: role},
                                                    (attr.CONNECTOR_NAME, "state"))
        self._transfer_templates: dict[int, int] = {}  # child index -> template of its transfer spans
        # Scheduler side: every request seen, None when not sampled.
        self._requests: dict[str, _RequestSpan | None] = {}
        self._loaders: dict[str, str] = {}  # traced request id -> name of the child chosen to load it
        self._finished_async: dict[str, _RequestSpan] = {}  # finished requests with async saves
        # Worker side: the bound step.
        self._step: tuple[TracedRequest, ...] = ()
        self._step_saved: list[TracedRequest] = []  # new: their KV is saved now
        self._step_loaded: dict[int, list[TracedRequest]] = {}  # child index -> the requests it loads
        self._step_contexts: dict[str, SpanContextIds] = {}
        self._step_span: SpanContextIds | None = None
        self._step_start = 0

    # ---- child calls, as their traced variant makes them (kvcompose.connectors.calls) ----

    def traced(self, spec: ChildSpec, operation: Operation, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` traced, as its operation's declaration says (kvcompose.operations), for the calls the
        instrumentation routes here: those about a sampled request, and those of a step that moves a sampled
        request's KV. A failure, or a call the circuit breaker skipped, reaches the span as the exception it
        raises."""
        if not operation.traced:
            return call
        base = self._child_attributes(spec)
        template = self._shipper.templates.register(operation.span_name, base, operation.attributes)
        if operation.granularity is Granularity.REQUEST:
            return self._request_call(spec, operation.name, template, operation.describe, call)
        traced = call
        if self._step_spans and (operation.granularity is Granularity.STEP or self._layer_spans):
            traced = self._step_call(template, operation.describe, call)
        if operation.name == "start_load_kv":
            load = self._shipper.templates.register("kvcompose.load", base)
            return self._per_request_call(load, spec.index, traced)
        if operation.name == "wait_for_save":
            save = self._shipper.templates.register("kvcompose.save", base)
            return self._per_request_call(save, None, traced)
        return traced

    def _child_attributes(self, spec: ChildSpec) -> dict[str, Any]:
        return {attr.CONNECTOR_NAME: spec.name, attr.CONNECTOR_INDEX: spec.index,
                attr.CONNECTOR_CLASS: spec.class_name, attr.ROLE: self._role}

    def _request_call(
        self, spec: ChildSpec, operation: str, template: int, describe: Describe | None, call: Callable[..., Any],
    ) -> Callable[..., Any]:
        """A span per call about a sampled request, under the request's span (request operations take
        no keyword arguments)."""
        note_loader = operation == "update_state_after_alloc"
        name = spec.name
        requests, loaders = self._requests, self._loaders
        run_span = self._span_runner(template, name, describe, call)

        def traced(*args: Any) -> Any:
            request = args[0]
            entry = requests.get(request.request_id)
            if entry is None:  # not sampled after all: vLLM asked about a request it already finished
                return call(*args)
            result = run_span(entry.trace_id, entry.span_id, request.request_id, args, None)
            if note_loader and args[2] > 0:
                loaders[request.request_id] = name
            return result

        return traced

    def _step_call(self, template: int, describe: Describe | None, call: Callable[..., Any]) -> Callable[..., Any]:
        name = self._shipper.templates.all[template].attributes[attr.CONNECTOR_NAME]
        run_span = self._span_runner(template, name, describe, call)

        def traced(*args: Any, **kwargs: Any) -> Any:
            if (step := self._step_span) is None:
                return call(*args, **kwargs)
            return run_span(step.trace_id, step.span_id, None, args, kwargs)

        return traced

    def _per_request_call(self, template: int, loader: int | None, call: Callable[..., Any]) -> Callable[..., Any]:
        """One span per traced request of the step, timed by this call, in that request's trace: those the child
        at index ``loader`` loads, or (None) those saved now."""
        random_bits = IDS.random_bits

        def traced(*args: Any, **kwargs: Any) -> Any:
            requests = self._step_saved if loader is None else self._step_loaded.get(loader)
            if not requests:
                return call(*args, **kwargs)
            start, error_type = time_ns(), None
            try:
                return call(*args, **kwargs)
            except Exception as error:
                error_type = qualified_name(type(error))
                raise
            finally:
                end = time_ns()
                for request in requests:
                    parent = self._step_contexts[request.request_id]
                    self._records.append((template, parent.trace_id, random_bits(64) or 1, parent.span_id, start,
                                          end, request.request_id, None, error_type, (), ()))

        return traced

    def _span_runner(
        self, template: int, child_name: str, describe: Describe | None, call: Callable[..., Any],
    ) -> Callable[[int, int, str | None, tuple[Any, ...], dict[str, Any] | None], Any]:
        """``run(trace_id, parent_id, request_id, args, kwargs)``: ``call`` as a span under ``parent_id``,
        with its timing, its failure, what its result says and the breaker events that happen during it.
        Runs on every traced call: everything it can look up is looked up here, once."""
        record, random_bits, current = self._records.append, IDS.random_bits, CURRENT_CALL

        def run(trace_id: int, parent_id: int, request_id: str | None, args: tuple[Any, ...],
                kwargs: dict[str, Any] | None) -> Any:
            span_id = random_bits(64) or 1
            outer_call, current.ids = current.ids, (trace_id, span_id, child_name)
            start = time_ns()
            error_type = values = None
            try:
                result = call(*args, **kwargs) if kwargs else call(*args)
            except Exception as error:
                error_type = qualified_name(type(error))
                raise
            else:
                if describe is not None:
                    try:
                        values = describe(args, result)
                    except Exception:  # a result of a shape the child should not return: described by nothing
                        values = None
                return result
            finally:
                end = time_ns()
                current.ids = outer_call
                record((template, trace_id, span_id, parent_id, start, end, request_id, values, error_type, (),
                        _CALL_EVENTS.pop(span_id, ()) if _CALL_EVENTS else ()))

        return run

    # ---- scheduler side ----

    def request_traced(self, request: Request) -> bool:
        """Whether the request is sampled; its span starts the first time a child is asked about it."""
        entry = self._requests.get(request.request_id, _UNSEEN)
        if entry is _UNSEEN:
            entry = self._start_request_span(request)
        return entry is not None

    def _start_request_span(self, request: Request) -> _RequestSpan | None:
        """The request's span (None when not sampled)."""
        req_id = request.request_id
        headers = request.trace_headers
        parent = parse_traceparent(headers.get("traceparent")) if headers else None
        trace_id, parent_id, parent_sampled = parent if parent is not None else (IDS.trace_id(), 0, None)
        entry = None
        if self._sampling.sampled(trace_id, parent_sampled):
            entry = _RequestSpan(trace_id, IDS.span_id(), parent_id, time_ns())
        self._requests[req_id] = entry
        return entry

    def request_finished(self, request: Request, saves_async: bool = False) -> None:
        """End the request's span (after every child was told it finished)."""
        req_id = request.request_id
        entry = self._requests.pop(req_id, None)
        loader = self._loaders.pop(req_id, None)
        if entry is not None:
            self._records.append((self._request_template, entry.trace_id, entry.span_id, entry.parent_id,
                                  entry.start_ns, time_ns(), req_id, (loader,), None, (), ()))
            if saves_async:
                self._finished_async[req_id] = entry

    def step_requests(
        self, scheduler_output: SchedulerOutput, loads: Mapping[str, LoadPlan] | None, moving: Collection[str] = ()
    ) -> tuple[TracedRequest, ...] | None:
        """The sampled requests whose KV the step being scheduled moves (new, loading, named in
        ``moving``, or finished with saves still running), for the workers."""
        new_requests = scheduler_output.scheduled_new_reqs
        if not (new_requests or loads or moving or self._finished_async):  # most decode steps
            return None
        requests = self._requests
        new_ids = [new.req_id for new in new_requests]
        traced = [TracedRequest(req_id, entry.trace_id, entry.span_id, True)
                  for req_id in new_ids if (entry := requests.get(req_id)) is not None]
        if loads or moving:
            others = set(loads or ()).union(moving).difference(new_ids)
            traced += [TracedRequest(req_id, entry.trace_id, entry.span_id, False)
                       for req_id in others if (entry := requests.get(req_id)) is not None]
        if self._finished_async:
            traced += [TracedRequest(req_id, entry.trace_id, entry.span_id, False)
                       for req_id, entry in self._finished_async.items()]
            self._finished_async.clear()
        return tuple(traced) or None

    # ---- worker side ----

    def begin_step(self, requests: tuple[TracedRequest, ...] | None, loads: Mapping[str, LoadPlan] | None) -> bool:
        """Bind the step's sampled requests and its loads (from the step's metadata); True if it has any."""
        if not requests:
            return False
        self._step_contexts.update((request.request_id, SpanContextIds(request.trace_id, request.span_id))
                                   for request in requests)
        self._step = requests
        self._step_saved, self._step_loaded = [request for request in requests if request.new], {}
        if loads:
            for request in requests:
                if (plan := loads.get(request.request_id)) is not None:
                    self._step_loaded.setdefault(plan.child, []).append(request)
        if self._step_spans:
            self._step_span = SpanContextIds(IDS.trace_id(), IDS.span_id())
            self._step_start = time_ns()
        return True

    def end_step(self) -> None:
        if not self._step:  # the step traced nothing (begin_step bound nothing)
            return
        if (step := self._step_span) is not None:
            links = tuple((context.trace_id, context.span_id) for context in self._step_contexts.values())
            self._records.append((self._step_template, step.trace_id, step.span_id, 0, self._step_start, time_ns(),
                                  None, (len(self._step),), None, links, ()))
        self._step, self._step_saved, self._step_loaded, self._step_contexts = (), [], {}, {}
        self._step_span = None

    def step_contexts(self) -> Mapping[str, SpanContextIds]:
        """Worker side: the span contexts of the bound step's traced requests, by request id."""
        return self._step_contexts

    def transfer(
        self, context: SpanContextIds, spec: ChildSpec, request_id: str, direction: str, start_ns: int, end_ns: int,
        blocks: int, nbytes: int, outcome: str, error_type: str | None = None,
    ) -> None:
        """A ``kvcompose.transfer`` span: one request, one child, one direction, start to completion; a failed
        one has status ERROR and ``error_type`` (an aborted one says so in its outcome)."""
        if (template := self._transfer_templates.get(spec.index)) is None:
            template = self._transfer_templates[spec.index] = self._shipper.templates.register(
                "kvcompose.transfer", self._child_attributes(spec),
                (attr.TRANSFER_DIRECTION, attr.TRANSFER_BLOCKS, attr.TRANSFER_BYTES, attr.TRANSFER_OUTCOME))
        self._records.append((template, context.trace_id, IDS.random_bits(64) or 1, context.span_id, start_ns,
                              end_ns, request_id, (direction, blocks, nbytes, outcome), error_type, (), ()))

    def breaker_changed(self, connector: str, state: str) -> None:
        """A ``kvcompose.circuit_breaker`` event on the traced call running now, or on a span of its own."""
        attributes = {attr.CONNECTOR_NAME: connector, "state": state}
        now = time_ns()
        if (running := CURRENT_CALL.ids) is not None:
            span_id = running[1]
            _CALL_EVENTS[span_id] = (*_CALL_EVENTS.get(span_id, ()), ("kvcompose.circuit_breaker", now, attributes))
            return
        trace_id = IDS.trace_id()
        if self._sampling.sampled(trace_id, None):
            self._records.append((self._breaker_template, trace_id, IDS.span_id(), 0, now, now, None,
                                  (connector, state), None, (), (("kvcompose.circuit_breaker", now, attributes),)))

    def telemetry(self) -> TelemetryCounters | None:
        """How span export keeps up since the last call (drops by reason, exporter restarts, spans waiting
        now); None when nothing changed. Pass it on as is."""
        return self._shipper.telemetry()

    def close(self) -> None:
        """End what is still open and export it, with what the outbox holds (engine shutting down)."""
        for req_id in list(self._requests):
            entry = self._requests.pop(req_id)
            if entry is not None:
                self._records.append((self._request_template, entry.trace_id, entry.span_id, entry.parent_id,
                                      entry.start_ns, time_ns(), req_id, (self._loaders.get(req_id),), None, (), ()))
        self._loaders.clear()
        self.end_step()
        self._shipper.release(self._records)

    @property
    def open_requests(self) -> int:
        return len(self._requests) + len(self._loaders) + len(self._finished_async)


class NoTracing:
    """What the instrumentation holds when tracing is off: nothing is traced or created."""

    open_requests = 0

    def request_finished(self, request: Request, saves_async: bool = False) -> None:
        pass

    def step_contexts(self) -> Mapping[str, SpanContextIds]:
        return {}

    def breaker_changed(self, connector: str, state: str) -> None:
        pass

    def telemetry(self) -> TelemetryCounters | None:
        return None

    def close(self) -> None:
        pass


def pipeline_tracer(pipeline: Pipeline, role: str, engine_id: str | None = None) -> PipelineTracer | NoTracing:
    """The composite's tracer: :class:`NoTracing` unless the pipeline enables tracing. With ``engine_id``
    (``vllm_config.kv_transfer_config.engine_id``), the spans waiting for export are also published on the
    engine's live board (:mod:`kvcompose.live`), so that the front-end's gauge stays true while no stats flow."""
    if not pipeline.tracing.enabled:
        return NoTracing()
    from kvcompose import __version__

    shipper = shipper_for(pipeline.tracing, __version__, pipeline.logging)
    if engine_id is not None:
        board(engine_id).watch(LIVE_SPANS_QUEUED, shipper.queued)
    return PipelineTracer(shipper, sampling_for(pipeline.tracing.sample_ratio), pipeline, role)

