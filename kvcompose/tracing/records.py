"""Span records: what the engine keeps of a span, and how a record becomes an OpenTelemetry span.

On the engine's hot path a span is a plain tuple (the fields of
:class:`SpanRecord`, in order): the id of its :class:`SpanTemplate`, trace
and span ids, start and end in ns since the epoch, the request id, and the
values of the template's keys. No OpenTelemetry object and no attribute dict
is made there: building and encoding SDK spans is most of what tracing costs
(docs/performance.md, "Tracing every request"). A template (span name, fixed
attributes, the names of the values) is registered once at start-up and
shipped once. Records become SDK ``ReadableSpan`` objects later, in the
exporter process (or in-process when a test or an embedder supplies its own
exporter), with their real timings and the ids the engine chose, so parents
and links stay exact.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from kvcompose.names import ERROR_TYPE, REQUEST_ID

SCOPE_NAME = "kvcompose"


class SpanTemplate(NamedTuple):
    """What every span of one kind shares. Marshal-able (plain values) once made a tuple."""

    name: str
    attributes: Mapping[str, Any]
    keys: tuple[str, ...]  # names of a record's ``values``, in order


class SpanRecord(NamedTuple):
    """One finished span. The hot path builds plain tuples in this field order."""

    template: int
    trace_id: int
    span_id: int
    parent_id: int  # 0: a root span
    start_ns: int
    end_ns: int
    request_id: str | None
    values: tuple[Any, ...] | None  # of the template's keys; a None value is left out
    error_type: str | None = None  # set: status ERROR with this ``error.type``
    links: tuple[tuple[int, int], ...] = ()  # (trace id, span id) of linked spans
    events: tuple[tuple[str, int, Mapping[str, Any]], ...] = ()  # (name, time ns, attributes)


class Templates:
    """The span templates of one process's shipper, numbered in registration order."""

    def __init__(self) -> None:
        self.all: list[SpanTemplate] = []
        self._ids: dict[SpanTemplate, int] = {}
        self._shipped = 0

    def register(self, name: str, attributes: Mapping[str, Any], keys: Sequence[str] = ()) -> int:
        template = SpanTemplate(name, dict(attributes), tuple(keys))
        key = SpanTemplate(name, tuple(sorted(template.attributes.items())), template.keys)  # type: ignore[arg-type]
        if (known := self._ids.get(key)) is not None:
            return known
        self._ids[key] = len(self.all)
        self.all.append(template)
        return self._ids[key]

    def unshipped(self) -> list[tuple[Any, ...]]:
        """Templates registered and not yet marked shipped, as plain tuples."""
        if self._shipped == len(self.all):  # almost always, once the process runs
            return []
        return [tuple(template) for template in self.all[self._shipped:]]

    def mark_shipped(self) -> None:
        self._shipped = len(self.all)

    def mark_unshipped(self) -> None:
        """A new exporter starts knowing no template: ship every one again."""
        self._shipped = 0


class IdSource:
    """Span and trace ids from a generator seeded by the OS.

    Not Python's shared ``random``: vLLM seeds it alike in every engine and
    worker process, and two servers of a prefill/decode pair would then hand
    out the same ids inside one trace. Re-seeded in a forked child.
    """

    def __init__(self) -> None:
        self._random = random.Random(os.urandom(32))
        os.register_at_fork(after_in_child=lambda: self._random.seed(os.urandom(32)))
        # ``random_bits(64) or 1`` is a span id (0 is not a valid one).
        self.random_bits = self._random.getrandbits

    def span_id(self) -> int:
        return self.random_bits(64) or 1

    def trace_id(self) -> int:
        return self._random.getrandbits(128) or 1


IDS = IdSource()


def parse_traceparent(value: str | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C traceparent, or None if absent or malformed."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(flags & 1)


def resource_for(service_name: str) -> Resource:
    return Resource.create({SERVICE_NAME: service_name})


def to_readable_spans(
    records: Iterable[Sequence[Any]], templates: Sequence[Sequence[Any]], resource: Resource, version: str
) -> list[ReadableSpan]:
    """SDK spans of the records, ready for any ``SpanExporter``; a record of a template not
    (yet) known is left out."""
    scope = InstrumentationScope(SCOPE_NAME, version)
    sampled = TraceFlags(TraceFlags.SAMPLED)
    spans = []
    for fields in records:
        record = SpanRecord(*fields)
        if record.template >= len(templates):
            continue
        template = SpanTemplate(*templates[record.template])
        attributes = dict(template.attributes)
        if record.request_id is not None:
            attributes[REQUEST_ID] = record.request_id
        for key, value in zip(template.keys, record.values or (), strict=False):
            if value is not None:
                attributes[key] = value
        status = Status(StatusCode.UNSET)
        if record.error_type is not None:
            attributes[ERROR_TYPE] = record.error_type
            status = Status(StatusCode.ERROR, record.error_type.rsplit(".", 1)[-1])
        parent = SpanContext(record.trace_id, record.parent_id, is_remote=False, trace_flags=sampled) if (
            record.parent_id) else None
        spans.append(ReadableSpan(
            name=template.name,
            context=SpanContext(record.trace_id, record.span_id, is_remote=False, trace_flags=sampled),
            parent=parent,
            resource=resource,
            attributes=attributes,
            events=[Event(name, dict(event_attributes), timestamp) for name, timestamp, event_attributes in
                    record.events],
            links=[Link(SpanContext(trace_id, span_id, is_remote=True, trace_flags=sampled))
                   for trace_id, span_id in record.links],
            kind=SpanKind.INTERNAL,
            status=status,
            start_time=record.start_ns,
            end_time=record.end_ns,
            instrumentation_scope=scope,
        ))
    return spans
