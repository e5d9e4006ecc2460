"""The exporter process's own OTLP encoding sends what the SDK's encoder would have sent."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvcompose.tracing.exporters import protobuf_transport, span_exporter
from kvcompose.tracing.otlp import OtlpEncoder
from kvcompose.tracing.records import IDS, SpanRecord, resource_for, to_readable_spans

from .otlp_support import start_receiver

TEMPLATES = [
    ("kvcompose.request", {"kvcompose.pipeline": "tiers"}, ("kvcompose.tokens.prompt",)),
    ("kvcompose.lookup", {"kvcompose.connector.name": "hot", "kvcompose.connector.index": 0},
     ("kvcompose.tokens.matched", "kvcompose.load.async", "kvcompose.ratio")),
]


def _records() -> list[tuple]:
    trace_id, root = IDS.trace_id(), IDS.span_id()
    records = [
        SpanRecord(0, trace_id, root, 0, 1_000, 9_000, "r1", (512,)),
        SpanRecord(1, trace_id, IDS.span_id(), root, 2_000, 3_000, "r1", (128, False, 0.5)),
        SpanRecord(1, trace_id, IDS.span_id(), root, 3_000, 4_000, "r1", (None, True, None)),  # None: left out
        SpanRecord(1, trace_id, IDS.span_id(), root, 4_000, 5_000, None, None, error_type="kvcompose.circuit_open",
                   links=((IDS.trace_id(), IDS.span_id()),),
                   events=(("kvcompose.circuit_breaker", 4_500, {"kvcompose.breaker.state": "open", "n": 3}),)),
        SpanRecord(7, trace_id, IDS.span_id(), root, 5_000, 6_000, "r1", ()),  # a template not yet known
    ]
    return [tuple(record) for record in records]


def test_records_encode_to_the_request_the_sdk_encoder_makes() -> None:
    resource = resource_for("svc")
    records = _records()
    encoder = OtlpEncoder(resource, "1.2.3")
    encoder.add_templates(TEMPLATES)
    spans = encoder.spans(records)

    sdk = encode_spans(to_readable_spans(records, TEMPLATES, resource, "1.2.3"))
    assert len(spans) == len(records) - 1
    assert ExportTraceServiceRequest.FromString(encoder.request(spans)) == sdk


def test_the_otlp_exporter_sends_encoded_requests_through_its_own_client() -> None:
    """Without the exporter's byte client the exporter process falls back to SDK spans, about
    twenty times the CPU per span: a newer opentelemetry-exporter-otlp-proto-http that drops
    it shows up here, not as a silent slowdown."""
    receiver = start_receiver()
    try:
        send = protobuf_transport(span_exporter("otlp", receiver.endpoint))
        assert send is not None, "the installed OTLP/HTTP exporter has no client that sends encoded requests"
        encoder = OtlpEncoder(resource_for("svc"), "0")
        encoder.add_templates(TEMPLATES)
        assert send(encoder.request(encoder.spans(_records())))
        received = receiver.received()
    finally:
        receiver.stop()

    assert [span.name for span in received] == ["kvcompose.request"] + ["kvcompose.lookup"] * 3
    assert {span.service for span in received} == {"svc"}
    assert protobuf_transport(span_exporter("console", None)) is None


def test_any_other_exporter_is_given_sdk_spans_in_the_exporter_process() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvcompose.tracing.export_process import RECORDS_FRAME, TEMPLATES_FRAME, _encoding_for, _Exporting

    exporter = InMemorySpanExporter()
    exporting = _Exporting(exporter, _encoding_for(exporter, "svc", "0"))
    records = _records()
    exporting.receive((TEMPLATES_FRAME, TEMPLATES))
    exporting.receive((RECORDS_FRAME, records))
    exporting.close()

    spans = exporter.get_finished_spans()
    assert [span.context.span_id for span in spans] == [SpanRecord(*record).span_id for record in records[:-1]]
    assert exporting.dropped == 1  # the record of a template it was never sent
