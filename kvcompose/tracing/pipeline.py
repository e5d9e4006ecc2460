"""The spans of one composite connector, at the pipeline's tracing granularity.

Scheduler side, every granularity: a ``kvcompose.request`` span per request
(the child of vLLM's request trace when the request carries a W3C
``traceparent``), and under it one span per per-request child call
(``kvcompose.lookup``, ``kvcompose.update_state_after_alloc``, ...).

Worker side, every granularity: ``kvcompose.load`` for each request a child
loads in a step and ``kvcompose.save`` for each request in its first step, per
saving child, both in the request's trace. The scheduler sends each request's
span context to the workers in the composite's metadata (:class:`TracedRequest`).

``step`` adds a ``kvcompose.step`` span per worker step that moves KV for a
sampled request (its first step, or a load), linked to each such request,
with the children's step calls under it; ``layer`` adds the per-layer calls.
Decode-only steps make no span: at a few milliseconds per step, a span per
step and child would cost more than the step's work (see ``make bench``).
Requests that are not sampled cost a dict look-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from time import time_ns
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context, attach, detach
from opentelemetry.trace import Link, Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvcompose.config import Pipeline
from kvcompose.metrics.recorder import OPERATION_LABELS
from kvcompose.tracing import attributes as attr
from kvcompose.tracing.provider import SHUTDOWN_FLUSH_MS, provider_for

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvcompose.connectors.children import ChildSpec
    from kvcompose.connectors.metadata import LoadPlan

# Scheduler-side child calls whose first argument is the request.
REQUEST_OPERATIONS = frozenset({
    "get_num_new_matched_tokens", "update_state_after_alloc", "request_finished", "request_finished_all_groups",
    "get_external_cache_hit_sources", "get_loaded_kv_cache_group_ids", "on_new_request",
    "register_finished_partial_tail",
})
# Worker-side calls made once per step.
STEP_OPERATIONS = frozenset({"start_load_kv", "wait_for_save", "get_transfer_results", "get_block_ids_with_load_errors"})
LAYER_OPERATIONS = frozenset({"save_kv_layer", "wait_for_layer_load"})

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class TracedRequest:
    """A sampled request in a step, as the workers need it to join its trace."""

    request_id: str
    traceparent: str
    new: bool  # its first step: the prompt's KV is saved now


@dataclass
class _RequestSpan:
    span: Span
    context: Context
    traceparent: str | None  # None when not sampled

    @property
    def sampled(self) -> bool:
        return self.traceparent is not None


class PipelineTracer:
    """Creates the spans of one composite; see the module docstring."""

    def __init__(self, tracer: Tracer, pipeline: Pipeline, role: str, flush: Callable[[], object]) -> None:
        self._tracer = tracer
        self._flush = flush
        self._pipeline = pipeline.name
        self._role = role
        self._step_spans = pipeline.tracing.granularity in ("step", "layer")
        self._layer_spans = pipeline.tracing.granularity == "layer"
        # Scheduler side.
        self._requests: dict[str, _RequestSpan] = {}
        # Worker side: the bound step.
        self._step: tuple[TracedRequest, ...] = ()
        self._step_loaders: dict[str, int] = {}  # request id -> index of the child loading it
        self._step_contexts: dict[str, Context] = {}
        self._step_span: Span | None = None
        self._step_context: Context | None = None

    # ---- wrapping child calls (once, at start-up) ----

    def wrap(self, spec: ChildSpec, operation: str, call: Callable[..., Any]) -> Callable[..., Any]:
        base = {
            attr.CONNECTOR_NAME: spec.name,
            attr.CONNECTOR_INDEX: spec.index,
            attr.CONNECTOR_CLASS: spec.class_name,
            attr.ROLE: self._role,
        }
        name = attr.span_name(OPERATION_LABELS.get(operation, operation))
        extract = attr.RESULT_ATTRIBUTES.get(operation)
        if operation in REQUEST_OPERATIONS:
            return self._request_call(spec, operation, name, base, extract, call)
        if operation in STEP_OPERATIONS or operation in LAYER_OPERATIONS:
            traced = call
            if self._step_spans and (operation in STEP_OPERATIONS or self._layer_spans):
                traced = self._step_call(name, base, extract, call)
            if operation == "start_load_kv":
                return self._per_request_call("kvcompose.load", base, self._loaded_by(spec.index), traced)
            if operation == "wait_for_save":
                return self._per_request_call("kvcompose.save", base, self._new_requests, traced)
            return traced
        return call

    def _request_call(
        self, spec: ChildSpec, operation: str, name: str, base: Mapping[str, Any],
        extract: Callable[..., Mapping[str, Any]] | None, call: Callable[..., Any],
    ) -> Callable[..., Any]:
        note_loader = operation == "update_state_after_alloc"

        def traced(request: Request, *args: Any, **kwargs: Any) -> Any:
            entry = self._request_span(request)
            if not entry.sampled:
                return call(request, *args, **kwargs)
            attributes = {**base, attr.REQUEST_ID: request.request_id}
            result = self._in_span(name, entry.context, attributes, extract, call, (request, *args), kwargs)
            if note_loader and args[1] > 0:
                entry.span.set_attribute(attr.LOADED_BY, spec.name)
            return result

        return traced

    def _step_call(
        self, name: str, base: Mapping[str, Any], extract: Callable[..., Mapping[str, Any]] | None,
        call: Callable[..., Any],
    ) -> Callable[..., Any]:
        def traced(*args: Any, **kwargs: Any) -> Any:
            if self._step_context is None:
                return call(*args, **kwargs)
            return self._in_span(name, self._step_context, base, extract, call, args, kwargs)

        return traced

    def _per_request_call(
        self, name: str, base: Mapping[str, Any], select: Callable[[], list[TracedRequest]], call: Callable[..., Any]
    ) -> Callable[..., Any]:
        """One span per selected request, timed by this call, in that request's trace."""

        def traced(*args: Any, **kwargs: Any) -> Any:
            requests = select()
            if not requests:
                return call(*args, **kwargs)
            start, failure = time_ns(), None
            try:
                return call(*args, **kwargs)
            except Exception as error:
                failure = error
                raise
            finally:
                self._emit(name, base, requests, start, time_ns(), failure)

        return traced

    def _in_span(
        self, name: str, parent: Context, attributes: Mapping[str, Any],
        extract: Callable[..., Mapping[str, Any]] | None, call: Callable[..., Any],
        args: tuple[Any, ...], kwargs: Mapping[str, Any],
    ) -> Any:
        span = self._tracer.start_span(name, context=parent, attributes=attributes)
        # The span is current during the call (error isolation marks the current
        # span), attached by hand: start_as_current_span costs ~20% more per span.
        token = attach(trace.set_span_in_context(span, parent))
        try:
            result = call(*args, **kwargs)
        except Exception as error:
            attr.mark_error(span, error)
            raise
        else:
            # A call that failed or was skipped (marked by error isolation) has no result to describe;
            # on a span the sampler dropped nothing is marked, so nothing is described either.
            if extract is not None and span.is_recording() and not attr.is_error(span):
                span.set_attributes(extract(args, result))
            return result
        finally:
            detach(token)
            span.end()

    def _emit(
        self, name: str, base: Mapping[str, Any], requests: Iterable[TracedRequest], start: int, end: int,
        failure: Exception | None,
    ) -> None:
        for request in requests:
            span = self._tracer.start_span(
                name, context=self._step_contexts[request.request_id],
                attributes={**base, attr.REQUEST_ID: request.request_id}, start_time=start,
            )
            if failure is not None:
                attr.mark_error(span, failure)
            span.end(end_time=end)

    def _loaded_by(self, index: int) -> Callable[[], list[TracedRequest]]:
        return lambda: [request for request in self._step if self._step_loaders.get(request.request_id) == index]

    def _new_requests(self) -> list[TracedRequest]:
        return [request for request in self._step if request.new]

    # ---- scheduler side ----

    def _request_span(self, request: Request) -> _RequestSpan:
        """The request's span, started the first time a child is asked about it."""
        if (entry := self._requests.get(request.request_id)) is not None:
            return entry
        parent = _PROPAGATOR.extract(request.trace_headers) if request.trace_headers else None
        span = self._tracer.start_span(
            "kvcompose.request", context=parent,
            attributes={attr.REQUEST_ID: request.request_id, attr.PIPELINE: self._pipeline, attr.ROLE: self._role},
        )
        context = trace.set_span_in_context(span)
        carrier: dict[str, str] = {}
        if span.is_recording():
            _PROPAGATOR.inject(carrier, context)
        entry = self._requests[request.request_id] = _RequestSpan(span, context, carrier.get("traceparent"))
        return entry

    def request_finished(self, request: Request) -> None:
        """End the request's span (after every child was told it finished)."""
        if (entry := self._requests.pop(request.request_id, None)) is not None:
            entry.span.end()

    def step_requests(
        self, scheduler_output: SchedulerOutput, loads: Mapping[str, LoadPlan] | None
    ) -> tuple[TracedRequest, ...] | None:
        """The sampled requests whose KV the step being scheduled moves (new or
        loading), for the workers."""
        new_ids = {new.req_id for new in scheduler_output.scheduled_new_reqs}
        ids = new_ids | set(loads or ())
        traced = tuple(
            TracedRequest(req_id, entry.traceparent, req_id in new_ids)
            for req_id in ids
            if (entry := self._requests.get(req_id)) is not None and entry.traceparent is not None
        )
        return traced or None

    # ---- worker side ----

    def begin_step(self, requests: tuple[TracedRequest, ...] | None, loads: Mapping[str, LoadPlan] | None) -> None:
        """Bind the step's sampled requests and its loads (from the step's metadata)."""
        if not requests:
            return
        self._step = requests
        self._step_loaders = {req_id: plan.child for req_id, plan in (loads or {}).items()}
        self._step_contexts = {r.request_id: _PROPAGATOR.extract({"traceparent": r.traceparent}) for r in requests}
        if self._step_spans:
            links = [Link(trace.get_current_span(ctx).get_span_context()) for ctx in self._step_contexts.values()]
            self._step_span = self._tracer.start_span(
                "kvcompose.step", links=links, attributes={attr.ROLE: self._role, attr.REQUESTS: len(requests)}
            )
            self._step_context = trace.set_span_in_context(self._step_span)

    def end_step(self) -> None:
        if self._step_span is not None:
            self._step_span.end()
        self._step, self._step_loaders, self._step_contexts = (), {}, {}
        self._step_span, self._step_context = None, None

    def breaker_changed(self, connector: str, state: str) -> None:
        """A ``kvcompose.circuit_breaker`` event on the current span, or on a span of its own
        when the change happens outside a traced call."""
        attributes = {attr.CONNECTOR_NAME: connector, "state": state}
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event("kvcompose.circuit_breaker", attributes)
            return
        own = self._tracer.start_span("kvcompose.circuit_breaker", attributes={**attributes, attr.ROLE: self._role})
        own.add_event("kvcompose.circuit_breaker", attributes)
        own.end()

    def close(self) -> None:
        """End what is still open and export it (engine shutting down)."""
        for entry in self._requests.values():
            entry.span.end()
        self._requests.clear()
        self.end_step()
        self._flush()

    @property
    def open_requests(self) -> int:
        return len(self._requests)


class NoTracing:
    """What the composite holds when tracing is off: nothing is wrapped or created."""

    open_requests = 0

    def wrap(self, spec: ChildSpec, operation: str, call: Callable[..., Any]) -> Callable[..., Any]:
        return call

    def request_finished(self, request: Request) -> None:
        pass

    def step_requests(self, scheduler_output: SchedulerOutput, loads: Mapping[str, LoadPlan] | None) -> None:
        return None

    def begin_step(self, requests: tuple[TracedRequest, ...] | None, loads: Mapping[str, LoadPlan] | None) -> None:
        pass

    def end_step(self) -> None:
        pass

    def breaker_changed(self, connector: str, state: str) -> None:
        pass

    def close(self) -> None:
        pass


def pipeline_tracer(pipeline: Pipeline, role: str) -> PipelineTracer | NoTracing:
    """The composite's tracer: :class:`NoTracing` unless the pipeline enables tracing."""
    if not pipeline.tracing.enabled:
        return NoTracing()
    from kvcompose import __version__

    provider = provider_for(pipeline.tracing)
    return PipelineTracer(
        provider.get_tracer("kvcompose", __version__), pipeline, role,
        flush=lambda: provider.force_flush(SHUTDOWN_FLUSH_MS),
    )
