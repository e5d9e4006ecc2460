"""A flushed shutdown: spans of requests that finished before `vllm serve` got SIGTERM (or an offline LLM was shut
down) reach the collector within the flush time, and kvcompose leaves nothing behind in /dev/shm.

On SIGTERM, vLLM's API server gives its engine core no time (``--shutdown-timeout`` 0): it SIGKILLs the engine
core's whole process tree at once (vllm/v1/utils.py ``shutdown`` -> ``kill_process_tree``); the connector's
``shutdown()`` never runs. Offline, ``LLM`` shutdown SIGTERMs the engine core and kills it after 5 s; its
workers' teardown takes most of that."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvcompose.testing.tiny_model import prompt_words

from .served_tracing import (
    any_exporter_left,
    descendants,
    kvcompose_files_of,
    settled_spans,
    span_names,
    start_traced_server,
    traced_completion,
)
from .span_engine import exporter_pids, server_exporter_pids
from .span_support import wait_until

pytestmark = pytest.mark.engine

FLUSH_S = 2.0  # tracing.shutdown_flush_s's default


def test_spans_of_requests_finished_before_sigterm_to_vllm_serve_reach_the_collector(
    tiny_model: Path, tmp_path: Path,
) -> None:
    server, receiver = start_traced_server(tiny_model, tmp_path, module="tests.serve_command")
    try:
        traces = {traced_completion(server, prompt_words(seed=900 + index, length=40))[0] for index in range(3)}
        engine_processes = descendants(server.process.pid)
        exporters = server_exporter_pids(server.process.pid)
        assert kvcompose_files_of(engine_processes)  # their live files
        time.sleep(1)
        server.process.send_signal(signal.SIGTERM)

        def every_request_span_arrived() -> bool:
            return span_names(settled_spans(receiver, traces, quiet_s=0, timeout_s=0))["kvcompose.request"] == 3

        # The exporter stops sending at the end of its flush time: every span that arrives arrived within it.
        wait_until(every_request_span_arrived, timeout_s=FLUSH_S + 30, poll_s=0.05)
        server.process.wait(60)
        spans = settled_spans(receiver, traces, quiet_s=1.0)
        wait_until(lambda: not any_exporter_left(exporters), timeout_s=FLUSH_S + 5)
    finally:
        server.stop()
        receiver.stop()
    per_trace = [span_names([span for span in spans if span.trace_id == trace]) for trace in traces]
    assert per_trace[0] == per_trace[1] == per_trace[2], per_trace
    assert per_trace[0]["kvcompose.transfer save hot"] == per_trace[0]["kvcompose.transfer save cold"] == 1
    assert kvcompose_files_of(engine_processes) == set()


def test_spans_of_requests_finished_before_an_offline_llm_shutdown_reach_the_collector(
    tiny_model: Path, tmp_path: Path,
) -> None:
    from kvcompose.config import load_pipeline
    from kvcompose.render import kv_transfer_config
    from kvcompose.testing.otlp_receiver import SpanReceiver

    from .engine_support import generate, start_llm

    receiver = SpanReceiver()
    pipeline = {"version": 1, "name": "offline", "children": [
        {"name": "hot", "connector": "ExampleConnector", "config": {"shared_storage_path": str(tmp_path / "hot")}}],
        "tracing": {"enabled": True, "sample_ratio": 1.0, "endpoint": receiver.endpoint}}
    # Only this LLM's processes: a session's other engines (a traced server fixture) are this process's
    # descendants too, and their exporters live as long as they do.
    earlier = set(descendants(os.getpid()))
    try:
        llm = start_llm(tiny_model, kv_transfer_config(load_pipeline(pipeline), pipeline))
        generate(llm, [prompt_words(seed=950 + index, length=40) for index in range(3)])
        engine_processes = [pid for pid in descendants(os.getpid()) if pid not in earlier]

        def engine_exporters() -> list[int]:
            return [pid for engine in engine_processes for pid in exporter_pids(engine)]

        # Each process starts its exporter when it first ships spans: the worker's may still be launching.
        wait_until(lambda: len(engine_exporters()) == 2, timeout_s=5)
        exporters = engine_exporters()
        time.sleep(1)
        # vLLM's shutdown is its own: it returns once the engine core exited or, 5 s after its SIGTERM, was
        # SIGKILLed (as it is on the CPU build even with no connector). What kvcompose owes is the spans.
        llm.llm_engine.engine_core.shutdown()

        def request_spans() -> int:
            return sum(1 for span in receiver.spans() if span.name == "kvcompose.request")

        wait_until(lambda: request_spans() == 3, timeout_s=FLUSH_S + 30)  # sent within the exporter's flush time
        wait_until(lambda: not any_exporter_left(exporters), timeout_s=FLUSH_S + 5)
    finally:
        receiver.stop()
    assert request_spans() == 3
    assert kvcompose_files_of(engine_processes) == set()
