"""Span records: what the engine keeps of a span, and how a record becomes an OpenTelemetry span.

On the engine's hot path a span is a plain tuple (:data:`SpanRecord`): names,
ids, start and end in ns since the epoch, attributes. No OpenTelemetry object
is made there; creating and encoding SDK spans costs tens of microseconds
each on these CPUs. Records are turned into SDK ``ReadableSpan`` objects
later, in the exporter process (or in-process when a test or an embedder
supplies its own exporter), with their real timings and the ids the engine
chose, so parents and links stay exact.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

SCOPE_NAME = "kvcompose"


class SpanRecord(NamedTuple):
    """One finished span. Marshal-able: ints, strings, floats, bools, tuples, dicts and None only."""

    name: str
    trace_id: int
    span_id: int
    parent_id: int  # 0: a root span
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]
    error_type: str | None = None  # set: status ERROR with this ``error.type``
    links: tuple[tuple[int, int], ...] = ()  # (trace id, span id) of linked spans
    events: tuple[tuple[str, int, Mapping[str, Any]], ...] = ()  # (name, time ns, attributes)


class IdSource:
    """Span and trace ids from a generator seeded by the OS.

    Not Python's shared ``random``: vLLM seeds it alike in every engine and
    worker process, and two servers of a prefill/decode pair would then hand
    out the same ids inside one trace. Re-seeded after a fork.
    """

    def __init__(self) -> None:
        self._pid = -1
        self._random = random.Random()

    def span_id(self) -> int:
        return self._draw(64)

    def trace_id(self) -> int:
        return self._draw(128)

    def _draw(self, bits: int) -> int:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._random.seed(os.urandom(32))
        return self._random.getrandbits(bits) or 1


IDS = IdSource()


def traceparent(trace_id: int, span_id: int) -> str:
    """A W3C traceparent header value for a sampled span."""
    return f"00-{trace_id:032x}-{span_id:016x}-01"


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


def to_readable_spans(records: Iterable[SpanRecord], resource: Resource, version: str) -> list[ReadableSpan]:
    """SDK spans of the records, ready for any ``SpanExporter``."""
    scope = InstrumentationScope(SCOPE_NAME, version)
    sampled = TraceFlags(TraceFlags.SAMPLED)
    spans = []
    for record in records:
        record = SpanRecord(*record)  # marshal hands back plain tuples
        attributes = dict(record.attributes)
        status = Status(StatusCode.UNSET)
        if record.error_type is not None:
            attributes["error.type"] = record.error_type
            status = Status(StatusCode.ERROR, record.error_type.rsplit(".", 1)[-1])
        parent = SpanContext(record.trace_id, record.parent_id, is_remote=False, trace_flags=sampled) if (
            record.parent_id) else None
        spans.append(ReadableSpan(
            name=record.name,
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
