"""Span records reach an OTLP/HTTP collector, through the exporter's public interface, as the spans they describe."""

from __future__ import annotations

from kvcompose.testing.otlp_receiver import SpanReceiver
from kvcompose.tracing.exporters import span_exporter
from kvcompose.tracing.records import IDS, SpanRecord, resource_for, to_readable_spans

TEMPLATES = [
    ("kvcompose.request", {"kvcompose.pipeline": "tiers"}, ("kvcompose.tokens.prompt",)),
    ("kvcompose.lookup", {"kvcompose.connector.name": "hot", "kvcompose.connector.index": 0},
     ("kvcompose.tokens.matched", "kvcompose.load.async", "kvcompose.ratio")),
]
TRACE, ROOT, LINKED_TRACE, LINKED_SPAN = IDS.trace_id(), IDS.span_id(), IDS.trace_id(), IDS.span_id()
RECORDS = [tuple(record) for record in (
    SpanRecord(0, TRACE, ROOT, 0, 1_000, 9_000, "r1", (512,)),
    SpanRecord(1, TRACE, IDS.span_id(), ROOT, 2_000, 3_000, "r1", (128, False, 0.5)),
    SpanRecord(1, TRACE, IDS.span_id(), ROOT, 3_000, 4_000, "r1", (None, True, None)),  # None: left out
    SpanRecord(1, TRACE, IDS.span_id(), ROOT, 4_000, 5_000, None, None, error_type="kvcompose.circuit_open",
               links=((LINKED_TRACE, LINKED_SPAN),),
               events=(("kvcompose.circuit_breaker", 4_500, {"kvcompose.breaker.state": "open", "n": 3}),)),
    SpanRecord(7, TRACE, IDS.span_id(), ROOT, 5_000, 6_000, "r1", ()),  # a template not yet known
)]


def test_records_reach_the_collector_as_the_spans_they_describe() -> None:
    receiver = SpanReceiver()
    try:
        spans = to_readable_spans(RECORDS, TEMPLATES, resource_for("svc"), "1.2.3")
        assert span_exporter("otlp", receiver.endpoint).export(spans).name == "SUCCESS"
        received = receiver.spans()
    finally:
        receiver.stop()

    assert len(received) == len(RECORDS) - 1  # the record of an unknown template is left out
    by_id = {int(span.span_id, 16): span for span in received}
    for fields in RECORDS[:-1]:
        record, span = SpanRecord(*fields), by_id[SpanRecord(*fields).span_id]
        assert (span.service, span.name, span.trace_id) == ("svc", TEMPLATES[record.template][0], format(TRACE, "032x"))
        assert span.parent_span_id == (format(record.parent_id, "016x") if record.parent_id else "")
        assert span.duration_ns == record.end_ns - record.start_ns
    root, matched, partial, failed = (by_id[SpanRecord(*fields).span_id] for fields in RECORDS[:-1])
    assert root.attributes == {"kvcompose.pipeline": "tiers", "gen_ai.request.id": "r1", "kvcompose.tokens.prompt": 512}
    assert matched.attributes == {"kvcompose.connector.name": "hot", "kvcompose.connector.index": 0,
                                  "gen_ai.request.id": "r1", "kvcompose.tokens.matched": 128,
                                  "kvcompose.load.async": False, "kvcompose.ratio": 0.5}
    assert "kvcompose.tokens.matched" not in partial.attributes and partial.attributes["kvcompose.load.async"] is True
    assert (failed.status_code, failed.status_message) == (2, "circuit_open")  # ERROR, the class's last name
    assert failed.attributes["error.type"] == "kvcompose.circuit_open" and "gen_ai.request.id" not in failed.attributes
    assert failed.links == ((format(LINKED_TRACE, "032x"), format(LINKED_SPAN, "016x")),)
    assert failed.events == (("kvcompose.circuit_breaker", 4_500, (("kvcompose.breaker.state", "open"), ("n", 3))),)
    assert {span.status_code for span in (root, matched, partial)} == {0}


def test_the_exporter_process_gives_any_exporter_sdk_spans_and_accounts_for_each() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvcompose.tracing.export_process import _Exporting
    from kvcompose.tracing.handover import RECORDS_FRAME, TEMPLATES_FRAME, Accounts

    exporter = InMemorySpanExporter()
    reports: list[Accounts] = []  # as sent to the engine
    exporting = _Exporting(exporter, reports.append, "svc", "0")
    exporting.receive((TEMPLATES_FRAME, TEMPLATES))
    exporting.receive((RECORDS_FRAME, RECORDS))
    assert exporting.flush(5.0) == 0
    counts = reports[-1].exported, reports[-1].unreadable

    spans = exporter.get_finished_spans()
    assert [span.context.span_id for span in spans] == [SpanRecord(*record).span_id for record in RECORDS[:-1]]
    assert counts == (4, 1)  # the record of a template it was never sent is counted, not lost silently
