"""kvcompose.testing.otlp_receiver: what opentelemetry-python's own OTLP/HTTP exporter sends arrives whole."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvcompose.testing.otlp_receiver import SpanReceiver


@pytest.fixture
def receiver() -> Iterator[SpanReceiver]:
    receiver = SpanReceiver()
    yield receiver
    receiver.stop()


def _send(receiver: SpanReceiver, compression: Compression) -> list[ReadableSpan]:
    """A parent and a child span exported to ``receiver``; the SDK's own record of them is returned."""
    kept = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "unit"}))
    provider.add_span_processor(SimpleSpanProcessor(kept))
    provider.add_span_processor(SimpleSpanProcessor(
        OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces", compression=compression)))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("parent", attributes={"text": "a", "count": 3, "ratio": 0.5, "on": True}):
        with tracer.start_as_current_span("child"):
            pass
    provider.shutdown()
    return list(kept.get_finished_spans())


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_spans_arrive_with_their_ids_times_and_attributes(receiver: SpanReceiver, compression: Compression) -> None:
    sent = _send(receiver, compression)
    received = {span.name: span for span in receiver.spans()}
    assert sorted(received) == ["child", "parent"]
    for span in sent:
        got = received[span.name]
        assert got.service == "unit"
        assert got.trace_id == f"{span.context.trace_id:032x}" and got.span_id == f"{span.context.span_id:016x}"
        assert got.parent_span_id == (f"{span.parent.span_id:016x}" if span.parent else "")
        assert (got.start_ns, got.end_ns) == (span.start_time, span.end_time)
        assert got.seconds == (span.end_time - span.start_time) / 1e9
        assert got.attributes == dict(span.attributes)
    assert received["parent"].attributes == {"text": "a", "count": 3, "ratio": 0.5, "on": True}
    assert receiver.spans(received["child"].trace_id) == receiver.spans()
    assert receiver.spans("0" * 32) == []
