"""`vllm serve` with tracing: the live gauge of spans waiting, and an exporter killed mid-traffic (one server)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose.testing.tiny_model import prompt_words

from .served_tracing import (
    kvcompose_spans,
    metric_value,
    settled_spans,
    span_names,
    start_traced_server,
    traced_completion,
)
from .span_engine import server_exporter_pids
from .span_support import wait_until

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def traced_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    server, receiver = start_traced_server(tiny_model, tmp_path_factory.mktemp("span-export"))
    yield server, receiver
    server.stop()
    receiver.stop()


def _queued(server: Any) -> float:
    return metric_value(server.metrics(), "kvcompose_spans_queued")


def test_spans_queued_returns_to_zero_on_metrics_after_traffic_stops(traced_server: tuple[Any, Any]) -> None:
    """The exporter holds spans for up to 2 s to batch them; the engine's last stats, sent while they waited,
    say so, and an idle engine sends no more. The live view brings the gauge back to 0 once they left."""
    server, receiver = traced_server
    traces, seen = set(), []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(_queued(server))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for index in range(12):
            traces.add(traced_completion(server, prompt_words(seed=500 + index, length=40))[0])
        # Back to 0 with no request after the last: the live view, not a later stats report, brought it there.
        wait_until(lambda: seen[-1] == 0 and bool(kvcompose_spans(receiver, traces)), timeout_s=15, poll_s=0.1)
    finally:
        done.set()
        watcher.join()
    assert max(seen) > 0, "spans never showed as waiting: the test would pass without the live view"
    assert settled_spans(receiver, traces) and _queued(server) == 0


def test_a_killed_exporter_mid_traffic_answers_every_request_and_delivers_or_counts_every_span(
    traced_server: tuple[Any, Any],
) -> None:
    server, receiver = traced_server
    log_lines_before = server.log.read_text(errors="replace").count("span_exporter_died")
    dropped_before = metric_value(server.metrics(), "kvcompose_spans_dropped_total", reason="exporter_down")
    restarts_before = metric_value(server.metrics(), "kvcompose_exporter_restarts_total")

    # A request's spans, new (saved to both tiers) and repeated (loaded from the first): what each pair makes.
    reference = prompt_words(seed=600, length=300)  # two full blocks: the repeat loads them
    pair = {traced_completion(server, reference)[0], traced_completion(server, reference)[0]}
    per_pair = span_names(settled_spans(receiver, pair))
    assert per_pair["kvcompose.request"] == 2 and per_pair["kvcompose.transfer load hot"] == 1, per_pair

    exporters = server_exporter_pids(server.process.pid)
    assert len(exporters) == 2  # the scheduler's (engine core) and the worker's
    prompts = [prompt_words(seed=700 + index, length=300) for index in range(10)]
    traces, texts, kill_after = set(), {}, 3

    for index, prompt in enumerate(prompts):
        if index == kill_after:
            for pid in exporters:
                os.kill(pid, signal.SIGKILL)
        first_trace, first = traced_completion(server, prompt)
        again_trace, again = traced_completion(server, prompt)  # loaded from the hot tier
        traces |= {first_trace, again_trace}
        texts[prompt] = (first, again)

    assert all(first == again and first for first, again in texts.values())
    wait_until(lambda: len(set(server_exporter_pids(server.process.pid)) - set(exporters)) == 2, timeout_s=30)
    # After the restart, a request's spans reach the collector again.
    after = {traced_completion(server, prompt_words(seed=800, length=40))[0]}
    wait_until(lambda: any(s.name == "kvcompose.request" for s in kvcompose_spans(receiver, after)), timeout_s=15)

    received = len(settled_spans(receiver, traces))
    expected = len(prompts) * sum(per_pair.values())
    metrics = server.metrics()
    dropped = metric_value(metrics, "kvcompose_spans_dropped_total", reason="exporter_down") - dropped_before
    assert received + dropped == expected, (received, dropped, expected)
    assert metric_value(metrics, "kvcompose_exporter_restarts_total") - restarts_before == 2, [
        line for line in metrics.splitlines() if line.startswith(("kvcompose_spans", "kvcompose_exporter"))]
    lines = [line for line in server.log.read_text(errors="replace").splitlines() if "span_exporter_died" in line]
    assert len(lines) - log_lines_before == 2  # one line per exporter killed
    assert {int(re.search(r'"pid": (\d+)', line)[1]) for line in lines[log_lines_before:]} == set(exporters)
