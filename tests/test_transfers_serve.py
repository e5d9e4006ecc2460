"""Transfers under the OpenAI server: vLLM's OffloadingConnector (kvcompose's CPU spec) in front of a disk tier.

A 300-word prompt is sent twice, each in its own caller trace: the first is
stored to the offload tier and the disk, the repeat is loaded from offload.
Each request's trace holds its ``kvcompose.transfer`` spans with real
durations (at least the copy time the offload worker reported to vLLM's own
metrics), /metrics has the transfer series, and a real Prometheus keeps a
trace id of those spans as an exemplar of the duration histogram.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcompose.testing.otlp_receiver import ReceivedSpan
from kvcompose.testing.tiny_model import prompt_words

from .engine_support import greedy
from .prometheus_support import api, start_prometheus, wait
from .server_support import Server, start_server

pytestmark = pytest.mark.engine

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "offload" / "pipeline.yaml"
PROMPT = prompt_words(seed=23, length=300)


@pytest.fixture(scope="module")
def offload_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, otlp_receiver: Any) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("offload-serve")
    pipeline = yaml.safe_load(EXAMPLE.read_text())
    pipeline["tracing"] = {"enabled": True, "granularity": "request", "service_name": "kvcompose-offload"}
    path = root / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    rendered = subprocess.run([sys.executable, "-m", "kvcompose", "render", str(path)],
                              capture_output=True, text=True, check=True).stdout.strip()
    env = {"KVCOMPOSE_DISK": str(root / "disk"), "KVCOMPOSE_OFFLOAD_BYTES": str(64 << 20),
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp_receiver.endpoint,
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    server = start_server(tiny_model, rendered, root / "server.log", env=env,
                          extra_args=["--otlp-traces-endpoint", otlp_receiver.endpoint])
    yield server
    server.stop()


def _spans(receiver: Any, trace_id: str, keep: Any, done: Any, seconds: float = 90) -> list[ReceivedSpan]:
    """The trace's spans that ``keep`` keeps, once ``done`` says they are all there (or ``seconds`` passed)."""
    deadline = time.monotonic() + seconds
    while True:
        spans = [s for s in receiver.spans() if s.trace_id == trace_id and keep(s)]
        if done(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.5)


def _transfers(receiver: Any, trace_id: str, done: Any) -> list[ReceivedSpan]:
    return _spans(receiver, trace_id, lambda span: span.name.startswith("kvcompose.transfer "), done)


def _durations_s(spans: list[ReceivedSpan], connector: str, direction: str) -> list[float]:
    return [span.duration_ns / 1e9 for span in spans if span.attributes["kvcompose.connector.name"] == connector
            and span.attributes["kvcompose.transfer.direction"] == direction]


def _metric(metrics: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_offload_transfers_are_traced_measured_and_exemplified(
    offload_server: Server, otlp_receiver: Any, plain_llm: Any, tmp_path: Path
) -> None:
    expected = plain_llm.generate([PROMPT], greedy(), use_tqdm=False)[0].outputs[0].text
    traces = [secrets.token_hex(16), secrets.token_hex(16)]
    texts = []
    for trace_id in traces:  # the first is saved to both tiers, the repeat loads from offload
        answer = offload_server.complete(PROMPT, headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
        texts.append(answer["choices"][0]["text"])
        time.sleep(1.0)  # the store jobs run after the request's step
    assert texts == [expected, expected]

    saved = _transfers(otlp_receiver, traces[0], lambda spans: _durations_s(spans, "offload", "save"))
    loaded = _transfers(otlp_receiver, traces[1], lambda spans: _durations_s(spans, "offload", "load"))
    assert _durations_s(saved, "offload", "save") and _durations_s(saved, "disk", "save"), saved
    assert _durations_s(loaded, "offload", "load") and not _durations_s(loaded, "disk", "load"), loaded
    for span in saved + loaded:
        assert span.duration_ns > 0 and span.attributes["kvcompose.transfer.outcome"] == "ok"
        assert span.attributes["kvcompose.transfer.bytes"] > 0 and span.attributes["kvcompose.transfer.blocks"] > 0

    # Each offload transfer lasts at least the copy its worker timed (vLLM's own kv_offload metrics), and its copy
    # time is that measurement: the copy time series add up to vLLM's own totals.
    metrics = offload_server.metrics()
    store_time = _metric(metrics, "vllm:kv_offload_store_time_total")
    load_time = _metric(metrics, "vllm:kv_offload_load_time_total")
    assert 0 < store_time <= sum(_durations_s(saved, "offload", "save")) + 1e-6
    assert 0 < load_time <= sum(_durations_s(loaded, "offload", "load")) + 1e-6
    for direction, measured in (("save", store_time), ("load", load_time)):
        copied = _metric(metrics, "kvcompose_transfer_copy_seconds_sum", connector="offload", direction=direction,
                         source="child")
        assert copied == pytest.approx(measured, rel=1e-3)
    # So do the bytes of those copies: the copy throughput's bytes and seconds are vLLM's own.
    for direction, job in (("save", "store"), ("load", "load")):
        assert _metric(metrics, "kvcompose_transfer_copied_bytes_total", connector="offload", direction=direction,
                       source="child") == _metric(metrics, f"vllm:kv_offload_{job}_bytes_total") > 0
    for span in saved + loaded:  # a copy time no longer than the transfer's lifetime, wherever it comes from
        assert 0 < span.attributes["kvcompose.transfer.copy_seconds"] * 1e9 <= span.duration_ns
    assert {span.attributes["kvcompose.transfer.copy_source"] for span in saved + loaded
            if span.attributes["kvcompose.connector.name"] == "disk"} == {"calls"}
    assert _metric(metrics, "kvcompose_engine_wait_seconds_total", connector="disk", direction="save") > 0

    # One miss, then one hit, for each child; the hit's tokens are vLLM's own count of external hits.
    for child in ("offload", "disk"):
        assert _metric(metrics, "kvcompose_lookups_total", connector=child, result="hit") == 1
        assert _metric(metrics, "kvcompose_lookups_total", connector=child, result="miss") == 1
        assert _metric(metrics, "kvcompose_matched_tokens_total", connector=child) == _metric(
            metrics, "vllm:external_prefix_cache_hits_total") > 0

    # The repeat's request span says which tier loaded it, and what its transfers did. It is the scheduler's: its
    # process exports apart from the worker's, whose transfer spans came in above.
    (repeat,) = _spans(otlp_receiver, traces[1], lambda span: span.name == "kvcompose.request", bool)
    assert repeat.attributes["kvcompose.load.connector"] == "offload"
    assert repeat.attributes["kvcompose.tier.offload.load_bytes"] == sum(
        span.attributes["kvcompose.transfer.bytes"] for span in loaded
        if span.attributes["kvcompose.connector.name"] == "offload")
    assert _metric(metrics, "vllm:kv_offload_load_bytes_total") == sum(
        span.attributes["kvcompose.transfer.bytes"] for span in loaded
        if span.attributes["kvcompose.connector.name"] == "offload")

    # The transfer series, per child and direction, in vLLM's /metrics.
    assert _metric(metrics, "kvcompose_transfer_lifetime_seconds_count", connector="offload", direction="load") >= 1
    assert _metric(metrics, "kvcompose_transfer_bytes_total", connector="disk", direction="save") > 0
    assert _metric(metrics, "kvcompose_transfers_in_flight", connector="offload", direction="load") == 0

    # A real Prometheus keeps the trace ids as exemplars of the duration histogram.
    prometheus = start_prometheus(offload_server.url, tmp_path, metrics_path="/metrics/", features=("exemplar-storage",))
    try:
        def exemplar_traces() -> set[str]:
            now = time.time()
            found = api(prometheus.url, "query_exemplars", {
                "query": "kvcompose_transfer_lifetime_seconds_bucket", "start": now - 600, "end": now + 60})
            return {exemplar["labels"]["trace_id"] for series in found for exemplar in series["exemplars"]}

        wait(lambda: exemplar_traces() & set(traces), 60, lambda: f"{exemplar_traces()}\n{prometheus.log.read_text()}")
    finally:
        prometheus.stop()

    # Ids, counts and timings only.
    for span in saved + loaded:
        assert not any(str(value) in PROMPT.split() for value in span.attributes.values())
    assert not re.search(r"w\d+ w\d+", str([span.attributes for span in saved + loaded]))
