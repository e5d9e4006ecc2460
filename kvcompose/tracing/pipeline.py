"""The spans of one composite connector, at the pipeline's tracing granularity.

A traced request's trace holds, at every granularity:

- a ``kvcompose.request`` span (the child of vLLM's request trace when the
  request carries a W3C ``traceparent``), ending when vLLM finishes the
  request, with a summary of what its transfers did: the child that loaded it
  and how many tokens, and per child and direction the lifetime, copy time and
  bytes of its transfers that ended by then;
- a ``kvcompose.lookup`` span per child asked about it, counting the times the
  child deferred it before ("ask again later", as OffloadingConnector answers
  while its lookup runs); at ``request`` granularity only each child's lookup
  of the round vLLM admitted the request on (and of a resumption after
  preemption), not those of the rounds a child deferred, unless slow;
- a ``kvcompose.transfer <direction> <child>`` span per transfer (see
  :mod:`kvcompose.instrumentation.transfers`), on the worker;
- at ``request`` granularity, the other calls about it only if they failed or
  took longer than ``tracing.slow_call_ms`` (a worker's step call counts for
  every traced request the step moves).

``step`` adds a ``kvcompose.step`` span per worker step that moves a traced
request's KV, linked to each such request, with every child call of the step
under it, and every call about the request on the scheduler; ``layer`` adds
the per-layer calls. Decode-only steps make no span.

Spans are plain tuples here (:class:`~kvcompose.tracing.records.SpanRecord`:
ids and clock reads, no OpenTelemetry object), appended to the tracer's
outbox, whose thread ships them (:mod:`kvcompose.tracing.outbox`). Which
calls are traced is the instrumentation's decision
(:mod:`kvcompose.instrumentation`); the tracer makes the spans.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from time import time_ns
from typing import TYPE_CHECKING, Any, NamedTuple

from kvcompose import names as attr
from kvcompose.config import Pipeline
from kvcompose.live import board
from kvcompose.logs import CURRENT_CALL, get_logger
from kvcompose.operations import DIRECTIONS, Operation
from kvcompose.tracing.records import IDS, parse_traceparent
from kvcompose.tracing.sampling import Sampling, sampling_for
from kvcompose.tracing.shipping import SpanShipper, shipper_for
from kvcompose.wire.metadata import Summaries, TracedRequest
from kvcompose.wire.telemetry import LIVE_SPANS_QUEUED, TelemetryCounters

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvcompose.child_spec import ChildSpec
    from kvcompose.wire.metadata import LoadPlan

logger = get_logger("tracing")

SUMMARY_FIELDS = ("lifetime_s", "copy_s", "bytes")


class SpanContextIds(NamedTuple):
    trace_id: int
    span_id: int


_UNSEEN = object()  # a request no child was asked about yet
# Breaker events that happen during a traced call, by the call's span id, until the call ends; shared by
# every tracer of the process, as is CURRENT_CALL. Almost always empty.
_CALL_EVENTS: dict[int, tuple[tuple[str, int, Mapping[str, Any]], ...]] = {}


@dataclass(slots=True)
class _RequestSpan:
    trace_id: int
    span_id: int
    parent_id: int
    start_ns: int
    loaded_by: str | None = None
    loaded_tokens: int | None = None
    summary: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    deferrals: dict[int, int] = field(default_factory=dict)  # child index -> lookups it deferred since it answered
    lookups: dict[int, list[tuple[Any, ...]]] = field(default_factory=dict)  # child index -> its latest lookup's spans


class CallSpan(NamedTuple):
    """A traced child call in progress: where its span goes, and the call it runs inside of (for logs)."""

    parents: tuple[SpanContextIds, ...]  # one span per parent: the first gets ``span_id``
    request_id: str | None
    span_id: int
    outer: tuple[int, int, str] | None


def summary_key(child: str, direction: str, name: str) -> str:
    """The request span's summary attribute of one child, direction and figure."""
    return f"kvcompose.tier.{child}.{direction}_{name}"


class PipelineTracer:
    """Records the spans of one composite; see the module docstring."""

    def __init__(self, shipper: SpanShipper, sampling: Sampling, pipeline: Pipeline, role: str) -> None:
        self._shipper = shipper
        self._sampling = sampling
        self._role = role
        self.granularity = pipeline.tracing.granularity
        self.slow_call_ns = int(pipeline.tracing.slow_call_ms * 1e6)
        self._records = shipper.outbox()  # of plain SpanRecord tuples; its thread ships them
        templates = shipper.templates
        self._summary_keys = [(child.name, direction, name) for child in pipeline.children
                              for direction in DIRECTIONS for name in SUMMARY_FIELDS]
        self._request_template = templates.register(
            "kvcompose.request", {attr.PIPELINE: pipeline.name, attr.ROLE: role},
            (attr.LOADED_BY, attr.LOADED_TOKENS, *(summary_key(*key) for key in self._summary_keys)))
        self._step_template = templates.register("kvcompose.step", {attr.ROLE: role}, (attr.REQUESTS,))
        self._breaker_template = templates.register("kvcompose.circuit_breaker", {attr.ROLE: role},
                                                    (attr.CONNECTOR_NAME, "state"))
        self._transfer_templates: dict[tuple[int, str], int] = {}  # (child index, direction) -> template
        # Scheduler side: every request seen, None when not sampled.
        self._requests: dict[str, _RequestSpan | None] = {}
        self._finished_async: dict[str, _RequestSpan] = {}  # finished requests with async saves
        # Worker side: the bound step.
        self._step: tuple[TracedRequest, ...] = ()
        self._step_contexts: dict[str, SpanContextIds] = {}
        self._step_span: SpanContextIds | None = None
        self._step_start = 0
        self._debug = logging.getLogger("kvcompose.tracing").isEnabledFor(logging.DEBUG)

    # ---- child calls ----

    def call_template(self, spec: ChildSpec, operation: Operation) -> int:
        """The span template of ``spec``'s calls of ``operation`` (registered once, at start-up)."""
        return self._shipper.templates.register(operation.span_name, self._child_attributes(spec),
                                                operation.attributes)

    def _child_attributes(self, spec: ChildSpec) -> dict[str, Any]:
        return {attr.CONNECTOR_NAME: spec.name, attr.CONNECTOR_INDEX: spec.index,
                attr.CONNECTOR_CLASS: spec.class_name, attr.ROLE: self._role}

    def start_call(self, parents: tuple[SpanContextIds, ...], request_id: str | None, child: str) -> CallSpan:
        """A traced call starts, under ``parents``: logs made during it carry its ids."""
        span_id = IDS.random_bits(64) or 1
        outer, CURRENT_CALL.ids = CURRENT_CALL.ids, (parents[0].trace_id, span_id, child)
        return CallSpan(parents, request_id, span_id, outer)

    def end_call(
        self, call: CallSpan, template: int, start_ns: int, end_ns: int, values: tuple[Any, ...] | None,
        error_type: str | None, record: bool,
    ) -> None:
        """The call ended: its span is recorded if ``record`` (one per parent), with the breaker events that
        happened during it."""
        events = self._call_ended(call)
        if record:
            self._records.extend(self._call_spans(call, template, start_ns, end_ns, values, error_type, events))

    def end_lookup(
        self, call: CallSpan, template: int, start_ns: int, end_ns: int, values: tuple[Any, ...], child: int,
        answered: bool, slow: bool,
    ) -> None:
        """A lookup of child ``child`` ended without failing; ``answered`` is false for "ask again later". Its span
        adds the child's deferrals of the request before it. At ``request`` granularity the child's latest lookup
        is held until vLLM admits the request (or it ends): the trace keeps the lookups of the round that settled,
        not those of the rounds some child deferred. A slow one is recorded at once."""
        events = self._call_ended(call)
        entry = self._requests.get(call.request_id) if call.request_id is not None else None
        deferrals = 0
        if entry is not None:
            deferrals = entry.deferrals.pop(child, 0)
            if not answered:
                entry.deferrals[child] = deferrals + 1
        spans = self._call_spans(call, template, start_ns, end_ns, (*values, deferrals), None, events)
        if entry is None or self.granularity != "request" or slow:
            self._records.extend(spans)
            if entry is not None:
                entry.lookups.pop(child, None)
        else:
            entry.lookups[child] = spans

    @staticmethod
    def _call_ended(call: CallSpan) -> tuple[Any, ...]:
        """Logs no longer carry the call's ids; the breaker events that happened during it."""
        CURRENT_CALL.ids = call.outer
        return _CALL_EVENTS.pop(call.span_id, ()) if _CALL_EVENTS else ()

    @staticmethod
    def _call_spans(
        call: CallSpan, template: int, start_ns: int, end_ns: int, values: tuple[Any, ...] | None,
        error_type: str | None, events: tuple[Any, ...],
    ) -> list[tuple[Any, ...]]:
        """The call's span records, one per parent: the first gets the call's span id."""
        spans = []
        for position, parent in enumerate(call.parents):
            span_id = call.span_id if not position else IDS.random_bits(64) or 1
            spans.append((template, parent.trace_id, span_id, parent.span_id, start_ns, end_ns, call.request_id,
                          values, error_type, (), events))
        return spans

    # ---- scheduler side ----

    def request_context(self, request: Request) -> SpanContextIds | None:
        """The request's span, if it is sampled; it starts the first time a child is asked about the request."""
        entry = self._requests.get(request.request_id, _UNSEEN)
        if entry is _UNSEEN:
            entry = self._start_request_span(request)
        return None if entry is None else SpanContextIds(entry.trace_id, entry.span_id)  # type: ignore[union-attr]

    def _start_request_span(self, request: Request) -> _RequestSpan | None:
        """The request's span (None when not sampled)."""
        headers = request.trace_headers
        parent = parse_traceparent(headers.get("traceparent")) if headers else None
        trace_id, parent_id, parent_sampled = parent if parent is not None else (IDS.trace_id(), 0, None)
        entry = None
        if self._sampling.sampled(trace_id, parent_sampled):
            entry = _RequestSpan(trace_id, IDS.span_id(), parent_id, time_ns())
        self._requests[request.request_id] = entry
        return entry

    def request_admitted(self, req_id: str) -> None:
        """vLLM allocated the request's blocks: its lookups held until now (each child's latest) are recorded."""
        if (entry := self._requests.get(req_id)) is not None and entry.lookups:
            self._record_lookups(entry)

    def _record_lookups(self, entry: _RequestSpan) -> None:
        for spans in entry.lookups.values():
            self._records.extend(spans)
        entry.lookups.clear()

    def request_loaded(self, req_id: str, child: str, tokens: int) -> None:
        """The traced request's tokens are loaded by ``child`` (its summary names it)."""
        if (entry := self._requests.get(req_id)) is not None:
            entry.loaded_by, entry.loaded_tokens = child, tokens

    def add_summaries(self, summaries: Summaries) -> None:
        """What the workers report of traced requests' transfers that ended."""
        for req_id, lines in summaries.items():
            if (entry := self._requests.get(req_id)) is None:
                continue
            for key, (lifetime_s, copy_s, nbytes) in lines.items():
                line = entry.summary.setdefault(key, [0.0, 0.0, 0.0])
                line[0] += lifetime_s
                line[1] += copy_s
                line[2] += nbytes

    def request_finished(self, request: Request, saves_async: bool = False) -> None:
        """End the request's span (after every child was told it finished)."""
        req_id = request.request_id
        entry = self._requests.pop(req_id, None)
        if entry is None:
            return
        self._end_request_span(req_id, entry)
        if saves_async:
            self._finished_async[req_id] = entry

    def _end_request_span(self, req_id: str, entry: _RequestSpan) -> None:
        if entry.lookups:  # asked about since its last admission, or never admitted
            self._record_lookups(entry)
        values: list[Any] = [entry.loaded_by, entry.loaded_tokens]
        for child, direction, name in self._summary_keys:
            if (line := entry.summary.get((child, direction))) is None:
                values.append(None)  # left out of the span
                continue
            value = line[SUMMARY_FIELDS.index(name)]
            values.append(int(value) if name == "bytes" else round(value, 6))
        end = time_ns()
        self._records.append((self._request_template, entry.trace_id, entry.span_id, entry.parent_id,
                              entry.start_ns, end, req_id, tuple(values), None, (), ()))
        if self._debug:
            logger.debug("request transfers", trace_id=format(entry.trace_id, "032x"),
                         span_id=format(entry.span_id, "016x"), loaded_by=entry.loaded_by,
                         loaded_tokens=entry.loaded_tokens,
                         transfers={f"{child}.{direction}": {"lifetime_s": round(lifetime, 6), "copy_s": round(copy, 6),
                                                             "bytes": int(nbytes)}
                                    for (child, direction), (lifetime, copy, nbytes) in entry.summary.items()})

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

    def begin_step(self, requests: Sequence[TracedRequest] | None) -> bool:
        """Bind the step's sampled requests (from the step's metadata); True if it has any."""
        if not requests:
            return False
        self._step = tuple(requests)
        self._step_contexts = {request.request_id: SpanContextIds(request.trace_id, request.span_id)
                               for request in requests}
        if self.granularity != "request":
            self._step_span = SpanContextIds(IDS.trace_id(), IDS.span_id())
            self._step_start = time_ns()
        return True

    def step_parents(self) -> tuple[SpanContextIds, ...]:
        """Where the bound step's call spans go: its step span, or (request granularity) every traced request."""
        if self._step_span is not None:
            return (self._step_span,)
        return tuple(self._step_contexts.values())

    def step_contexts(self) -> Mapping[str, SpanContextIds]:
        """The span contexts of the bound step's traced requests, by request id."""
        return self._step_contexts

    def end_step(self) -> None:
        if not self._step:  # the step traced nothing
            return
        if (step := self._step_span) is not None:
            links = tuple((context.trace_id, context.span_id) for context in self._step_contexts.values())
            self._records.append((self._step_template, step.trace_id, step.span_id, 0, self._step_start, time_ns(),
                                  None, (len(self._step),), None, links, ()))
        self._step, self._step_contexts, self._step_span = (), {}, None

    def transfer(
        self, context: SpanContextIds, spec: ChildSpec, request_id: str, direction: str, start_ns: int, end_ns: int,
        blocks: int, nbytes: int, outcome: str, copy_s: float | None, copy_source: str | None,
        error_type: str | None = None,
    ) -> None:
        """A ``kvcompose.transfer <direction> <child>`` span: one request, one child, one direction, from issue to
        completion (its lifetime); a failed one has status ERROR and ``error_type`` (an aborted one says so in its
        outcome)."""
        if (template := self._transfer_templates.get((spec.index, direction))) is None:
            template = self._transfer_templates[(spec.index, direction)] = self._shipper.templates.register(
                f"{attr.TRANSFER_SPAN} {direction} {spec.name}",
                {**self._child_attributes(spec), attr.TRANSFER_DIRECTION: direction},
                (attr.TRANSFER_BLOCKS, attr.TRANSFER_BYTES, attr.TRANSFER_OUTCOME, attr.TRANSFER_COPY_SECONDS,
                 attr.TRANSFER_COPY_SOURCE))
        self._records.append((template, context.trace_id, IDS.random_bits(64) or 1, context.span_id, start_ns,
                              end_ns, request_id, (blocks, nbytes, outcome, copy_s, copy_source), error_type, (), ()))

    # ---- both ----

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
        for req_id, entry in list(self._requests.items()):
            if entry is not None:
                self._end_request_span(req_id, entry)
        self._requests.clear()
        self.end_step()
        self._shipper.release(self._records)

    @property
    def open_requests(self) -> int:
        return len(self._requests) + len(self._finished_async)


def pipeline_tracer(pipeline: Pipeline, role: str, engine_id: str | None = None) -> PipelineTracer | None:
    """The composite's tracer: None unless the pipeline enables tracing. With ``engine_id``
    (``vllm_config.kv_transfer_config.engine_id``), the spans waiting for export are also published on the
    engine's live board (:mod:`kvcompose.live`), so that the front-end's gauge stays true while no stats flow."""
    if not pipeline.tracing.enabled:
        return None
    from kvcompose import __version__

    shipper = shipper_for(pipeline.tracing, __version__, pipeline.logging)
    if engine_id is not None:
        board(engine_id).watch(LIVE_SPANS_QUEUED, shipper.queued)
    return PipelineTracer(shipper, sampling_for(pipeline.tracing.sample_ratio), pipeline, role)
