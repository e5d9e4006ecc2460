"""Spans exported in-process for a test to read."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvcompose.tracing import force_flush


class FlushedSpans(InMemorySpanExporter):
    """kvcompose's spans in memory, as they stand when read: the outboxes' thread ships every 0.1 s, so
    reading and clearing first ship what the tracers recorded until then."""

    def get_finished_spans(self) -> Any:
        force_flush()
        return super().get_finished_spans()

    def clear(self) -> None:
        force_flush()
        super().clear()
