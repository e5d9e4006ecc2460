"""A traced `vllm serve` of examples/observability/pipeline.yaml for the span export and shutdown tests: its own
collector, its stores under a temp dir, and the names and counts of the kvcompose spans of its requests."""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from kvcompose.testing.otlp_receiver import ReceivedSpan, SpanReceiver

from .server_support import Server, start_server

PIPELINE = Path(__file__).resolve().parents[1] / "examples" / "observability" / "pipeline.yaml"


def start_traced_server(model: Path, root: Path, module: str = "vllm.entrypoints.openai.api_server"
                        ) -> tuple[Server, SpanReceiver]:
    """The example pipeline with its stores under ``root``, and no span for a slow call (a request then makes
    the same spans every time, so that spans can be counted exactly)."""
    import yaml

    receiver = SpanReceiver()
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    pipeline = yaml.safe_load(PIPELINE.read_text())
    for child in pipeline["children"]:
        child["config"]["shared_storage_path"] = str(root / child["name"])
    pipeline["tracing"]["slow_call_ms"] = 3_600_000
    (root / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    rendered = subprocess.run([sys.executable, "-m", "kvcompose", "render", str(root / "pipeline.yaml")],
                              capture_output=True, text=True, check=True).stdout.strip()
    try:
        server = start_server(model, rendered, root / "server.log", env=env, module=module,
                              extra_args=["--otlp-traces-endpoint", receiver.endpoint])
    except BaseException:
        receiver.stop()
        raise
    return server, receiver


def traced_completion(server: Server, prompt: str, max_tokens: int = 8) -> tuple[str, str]:
    """(trace id, text) of a completion sent with a sampled traceparent of its own."""
    trace_id = secrets.token_hex(16)
    body = server.complete(prompt, max_tokens=max_tokens,
                           headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    return trace_id, body["choices"][0]["text"]


def kvcompose_spans(receiver: SpanReceiver, trace_ids: set[str]) -> list[ReceivedSpan]:
    return [span for span in receiver.spans() if span.trace_id in trace_ids and span.name.startswith("kvcompose.")]


def span_names(spans: list[ReceivedSpan]) -> Counter[str]:
    return Counter(span.name for span in spans)


def settled_spans(receiver: SpanReceiver, trace_ids: set[str], quiet_s: float = 3.0,
                  timeout_s: float = 30.0) -> list[ReceivedSpan]:
    """The kvcompose spans of those traces once no more came for ``quiet_s``."""
    deadline, last, last_change = time.monotonic() + timeout_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        spans = kvcompose_spans(receiver, trace_ids)
        if len(spans) != last:
            last, last_change = len(spans), time.monotonic()
        elif time.monotonic() - last_change >= quiet_s:
            return spans
        time.sleep(0.2)
    return kvcompose_spans(receiver, trace_ids)


def metric_value(metrics: str, name: str, **labels: str) -> float:
    """The sum of a series' samples whose labels include ``labels`` (0 when there is none)."""
    total = 0.0
    for match in re.finditer(rf'^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$', metrics, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match[1]))
        if all(found.get(key) == value for key, value in labels.items()):
            total += float(match[2])
    return total


def kvcompose_files_of(pids: list[int], directory: str = "/dev/shm") -> set[str]:
    """kvcompose's files there that name one of these processes (a live file names its process; kvcompose's span
    hand-over is a pipe, with no file). Other engines on the machine may have files of their own."""
    return {path.name for path in Path(directory).iterdir()
            if "kvcompose" in path.name and any(f"-{pid}." in path.name for pid in pids)}


def descendants(pid: int) -> list[int]:
    import psutil

    return [process.pid for process in psutil.Process(pid).children(recursive=True)]


def any_exporter_left(pids: list[int]) -> bool:
    import psutil

    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            continue
    return False
