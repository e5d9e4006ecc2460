"""Span records leave the engine process: the exporter process, its bounds and its counts; sampling settings."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose.config import TracingSection
from kvcompose.testing.otlp_receiver import SpanReceiver
from kvcompose.tracing.export_process import CHECK_ENGINE_S, READ_EVERY_S
from kvcompose.tracing.handover import EngineLink, ExporterLink
from kvcompose.tracing.records import IDS, SpanRecord
from kvcompose.tracing.sampling import Sampling, sampling_for
from kvcompose.tracing.shipping import ProcessShipper

from .span_support import wait_until


def _records(shipper: ProcessShipper, count: int, trace_id: int) -> list[tuple]:
    template = shipper.templates.register("kvcompose.lookup", {"kvcompose.connector.name": "hot"},
                                          ("kvcompose.tokens.matched",))
    now = time.time_ns()
    return [tuple(SpanRecord(template, trace_id, IDS.span_id(), 7, now, now + 1000, "r1", (i,))) for i in range(count)]


def test_the_exporter_process_exports_records_as_spans_with_their_ids() -> None:
    receiver = SpanReceiver()
    try:
        shipper = ProcessShipper(TracingSection(enabled=True, endpoint=receiver.endpoint, service_name="svc"), "0")
        trace_id = IDS.trace_id()
        sent = _records(shipper, 3, trace_id)
        shipper.ship(sent)
        shipper.close()  # end of input: it flushes, then exits
        wait_until(lambda: len(receiver.spans()) == 3, timeout_s=5)
        received = receiver.spans()
    finally:
        receiver.stop()

    assert sorted(int(span.span_id, 16) for span in received) == sorted(SpanRecord(*record).span_id for record in sent)
    assert {(span.service, span.trace_id, span.parent_span_id) for span in received} == {
        ("svc", format(trace_id, "032x"), format(7, "016x"))}
    assert sorted(span.attributes["kvcompose.tokens.matched"] for span in received) == [0, 1, 2]
    assert {(span.name, span.attributes["gen_ai.request.id"], span.attributes["kvcompose.connector.name"])
            for span in received} == {("kvcompose.lookup", "r1", "hot")}


def test_a_shipper_closed_and_used_again_ships_its_templates_to_the_new_exporter() -> None:
    """Two composites of one pipeline in one process share a shipper; when the first one
    shuts down, the second one's next batch starts a new exporter process, which must be
    told every template again (it once died on the first record of a known template)."""
    receiver = SpanReceiver()
    try:
        shipper = ProcessShipper(TracingSection(enabled=True, endpoint=receiver.endpoint), "0")
        first, second = IDS.trace_id(), IDS.trace_id()
        shipper.ship(_records(shipper, 2, first))
        shipper.close()
        shipper.ship(_records(shipper, 3, second))
        shipper.close()
        wait_until(lambda: len(receiver.spans()) == 5, timeout_s=10)
        received = receiver.spans()
    finally:
        receiver.stop()

    by_trace = sorted(span.trace_id for span in received)
    assert by_trace == sorted([format(first, "032x")] * 2 + [format(second, "032x")] * 3)


def test_a_sleeping_exporter_is_woken_by_a_ship() -> None:
    """An idle exporter sleeps (no polling) and checks its engine only every CHECK_ENGINE_S: records shipped
    meanwhile must wake it at once, not wait for that check."""
    receiver = SpanReceiver()
    shipper = ProcessShipper(TracingSection(enabled=True, endpoint=receiver.endpoint), "0")
    try:
        shipper.ship(_records(shipper, 2, IDS.trace_id()))
        exporter = shipper._exporter
        assert exporter is not None
        for _ in range(3):  # each time: it took everything, and its next read found nothing: asleep; a ship wakes it
            wait_until(lambda: not exporter.unread())
            time.sleep(1.5 * READ_EVERY_S)
            shipper.ship(_records(shipper, 2, IDS.trace_id()))
            wait_until(lambda: not exporter.unread(), timeout_s=CHECK_ENGINE_S / 2)
    finally:
        shipper.close()
        receiver.stop()


@contextlib.contextmanager
def _exporter_that_just_read() -> Iterator[tuple[ProcessShipper, ExporterLink]]:
    """A shipper whose exporter process has just read its first ship (records came: it reads again in
    READ_EVERY_S, unless woken), and the engine's end of the pipes between them."""
    receiver = SpanReceiver()
    shipper = ProcessShipper(TracingSection(enabled=True, endpoint=receiver.endpoint), "0")
    try:
        shipper.ship(_records(shipper, 2, IDS.trace_id()))
        exporter = shipper._exporter
        assert exporter is not None
        wait_until(lambda: not exporter.unread())
        yield shipper, exporter
    finally:
        shipper.close()
        receiver.stop()


def test_while_records_keep_coming_the_exporter_reads_on_its_schedule_not_at_every_ship() -> None:
    """A wake-up costs the exporter about 0.1 ms of CPU, and a tracing engine ships ten times a second: once
    awake it reads every READ_EVERY_S, not once per ship."""
    with _exporter_that_just_read() as (shipper, exporter):
        reads, unread, ships = 0, 0, 0
        began = time.monotonic()
        while (elapsed := time.monotonic() - began) < 2 * READ_EVERY_S:
            if elapsed >= ships * 0.05:  # twenty ships a second
                shipper.ship(_records(shipper, 2, IDS.trace_id()))
                ships, unread = ships + 1, exporter.unread()
            if (now_unread := exporter.unread()) < unread:  # only a read takes bytes out of the pipe
                reads += 1
            unread = now_unread
            time.sleep(0.001)
    assert ships >= 30
    assert 1 <= reads <= 4, f"{reads} reads for {ships} ships in {2 * READ_EVERY_S} s"


def test_a_pipe_half_full_wakes_the_exporter_before_its_next_read() -> None:
    with _exporter_that_just_read() as (shipper, exporter):
        shipper.ship(_records(shipper, 2, IDS.trace_id()))
        time.sleep(READ_EVERY_S / 10)
        assert exporter.unread(), "read at once: the exporter is woken by every ship"
        shipped = time.monotonic()
        while 2 * exporter.unread() <= exporter.capacity:
            shipper.ship(_records(shipper, 2000, IDS.trace_id()))
        wait_until(lambda: not exporter.unread(), timeout_s=READ_EVERY_S)
        assert time.monotonic() - shipped < READ_EVERY_S * 0.9


def test_a_collector_outage_drops_and_counts_with_bounded_memory() -> None:
    with socket.socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    shipper = ProcessShipper(TracingSection(enabled=True, endpoint=f"http://127.0.0.1:{port}"), "0")
    try:
        for _ in range(40):
            shipper.ship(_records(shipper, 500, IDS.trace_id()))  # 20,000 spans, 5x the exporter's queue
        dropped = 0

        def counted() -> bool:
            nonlocal dropped
            if (report := shipper.telemetry()) is None:
                return False
            dropped += report.spans_dropped
            return dropped >= 20_000 - 4096 and (report.spans_queued or 0) <= 4096

        wait_until(counted, poll_s=0.05)
    finally:
        shipper.close()


@pytest.mark.parametrize(("ratio", "environ", "expected"), [
    (0.25, {"OTEL_TRACES_SAMPLER": "always_off"}, Sampling(True, 0.25)),  # the pipeline's ratio wins
    (None, {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
     Sampling(True, 0.1)),
    (None, {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.3"}, Sampling(False, 0.3)),
    (None, {"OTEL_TRACES_SAMPLER": "always_off"}, Sampling(False, 0.0)),
    (None, {}, Sampling(True, 1.0)),
    (None, {"OTEL_TRACES_SAMPLER": "jaeger_remote"}, Sampling(True, 1.0)),  # unsupported: warned, all traced
    (None, {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, Sampling(False, 1.0)),
])
def test_sampling_settings(ratio: float | None, environ: dict[str, str], expected: Sampling) -> None:
    assert sampling_for(ratio, environ) == expected


def _openmp_runtime() -> str | None:
    """The OpenMP runtime vLLM's CPU backend preloads into its processes: torch's libgomp."""
    torch = importlib.util.find_spec("torch")
    if torch is None or torch.origin is None:
        return None
    found = sorted((Path(torch.origin).parent / "lib").glob("libgomp*.so*"))
    return str(found[0]) if found else None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a machine of two cores or more, with CPU affinity")
def test_the_exporter_runs_on_every_core_though_its_engine_is_pinned_to_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU backend pins the engine's threads to the cores its OpenMP threads keep busy, and gives its worker
    processes an environment that binds OpenMP's first thread to them (``GOMP_CPU_AFFINITY``, ``OMP_PLACES``,
    ``OMP_PROC_BIND``, with libgomp preloaded), which a process started from there inherits. An exporter that kept
    either pin got no time beside the busy threads, and a prefill/decode pair's spans waited until shutdown."""
    receiver = SpanReceiver()
    every_core = os.sched_getaffinity(0)
    engine_core = min(every_core)
    if (openmp := _openmp_runtime()) is not None:
        monkeypatch.setenv("LD_PRELOAD", openmp)
    monkeypatch.setenv("GOMP_CPU_AFFINITY", str(engine_core))
    monkeypatch.setenv("OMP_PLACES", f"{{{engine_core}}}")
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    os.sched_setaffinity(0, {engine_core})  # as vLLM pins the thread that builds the connector
    try:
        shipper = ProcessShipper(TracingSection(enabled=True, endpoint=receiver.endpoint), "0")
        shipper.ship(_records(shipper, 1, IDS.trace_id()))
    finally:
        os.sched_setaffinity(0, every_core)
    try:
        exporter = shipper._exporter
        assert exporter is not None
        wait_until(lambda: exporter.pid is not None)
        assert os.sched_getaffinity(exporter.pid) == every_core
        wait_until(lambda: len(receiver.spans()) == 1)
    finally:
        shipper.close()
        receiver.stop()


def test_sampling_follows_the_caller_and_the_ratio_on_trace_ids() -> None:
    half = Sampling(parent_based=True, root_ratio=0.5)
    assert half.sampled(trace_id=(1 << 64) - 1, parent_sampled=True)
    assert not half.sampled(trace_id=0, parent_sampled=False)
    kept = sum(half.sampled(IDS.trace_id(), None) for _ in range(4000))
    assert 1700 < kept < 2300
    assert not Sampling(parent_based=False, root_ratio=0.0).sampled(1, parent_sampled=True)


def test_a_request_without_a_caller_is_a_root_whatever_span_is_current() -> None:
    """vLLM's own tracing, or another request's caller, may leave a span current on the engine's thread: a request
    without a traceparent is decided by its trace id all the same, not by that span's flag."""
    from opentelemetry import context, trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    unsampled = NonRecordingSpan(SpanContext(7, 7, is_remote=True, trace_flags=TraceFlags(TraceFlags.DEFAULT)))
    token = context.attach(trace.set_span_in_context(unsampled))
    try:
        assert Sampling(parent_based=True, root_ratio=1.0).sampled(IDS.trace_id(), None)
    finally:
        context.detach(token)


def test_the_pipe_keeps_frames_in_order_and_refuses_whole_what_does_not_fit(monkeypatch: Any) -> None:
    import os

    from kvcompose.tracing import handover

    monkeypatch.setattr(handover, "PIPE_BYTES", 4 * 4096)  # the least a pipe holds is a page; room: 2 pages
    writer = ExporterLink({"settings": 1})
    accounts_read, accounts_write = os.pipe()
    reader = EngineLink(os.dup(writer._data_read), os.dup(writer._wake_read), accounts_write)
    assert reader.take() == [{"settings": 1}]
    for round_index in range(200):  # 200 x ~1 KiB through 16 KiB: many times its size
        frame = ("r", [round_index, "x" * 1000])
        assert writer.append(*frame)
        assert reader.take() == [frame]
    assert writer.append("r", ["y" * 4000]) and not writer.append("r", ["z" * 5000])  # the second has no room
    assert writer.unread_records() == [["y" * 4000]]  # written, not yet read
    assert reader.take() == [("r", ["y" * 4000])] and writer.unread_records() == []
    assert writer.append("r", ["z" * 5000])
    assert reader.take() == [("r", ["z" * 5000])]
    writer.close()
    for fd in (accounts_read, accounts_write):
        os.close(fd)
