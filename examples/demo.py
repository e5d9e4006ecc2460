"""`make demo`: kvcompose's headline in about 20 lines.

Starts vLLM's OpenAI server on the CPU with ``kvcompose serve`` and
examples/offload/pipeline.yaml: vLLM's OffloadingConnector on kvcompose's
CPU offloading spec (host memory) in front of vLLM's ExampleConnector
(disk). Tracing is on (``--trace``) and goes to an OTLP/HTTP receiver that
runs inside this script (kvcompose.testing.otlp_receiver), so no Jaeger or
Collector is needed.

It sends one prompt twice: the first is computed and stored to both tiers,
the repeat is loaded from the offload tier. Then it prints each tier's
figures as ``kvcompose top`` reads them from the server's /metrics/, and the
repeat's trace (the one the offload load's exemplar names) as a text
waterfall. vLLM's own output goes to a log file; the received spans and the
/metrics/ exposition are written beside it.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcompose.testing.otlp_receiver import ReceivedSpan, SpanReceiver
from kvcompose.testing.tiny_model import ensure_tiny_model, prompt_words
from kvcompose.top import COLUMNS, OPENMETRICS, Scrape, ScrapeError, cells, frame, parse

REPO = Path(__file__).resolve().parents[1]
PIPELINE = Path("examples/offload/pipeline.yaml")  # relative to REPO, as the printed command shows it
OFFLOAD_BYTES = str(64 << 20)  # the offload tier's host memory, unless KVCOMPOSE_OFFLOAD_BYTES says otherwise
PROMPT = prompt_words(seed=7, length=300)  # 434 tokens: three full 128-token CPU blocks can be stored
MAX_TOKENS = 8
STARTUP_TIMEOUT_S = 240.0
SETTLE_TIMEOUT_S = 20.0
BAR_WIDTH = 28
LIFETIME_COUNT = "kvcompose_transfer_lifetime_seconds_count"
LIFETIME_BUCKET = "kvcompose_transfer_lifetime_seconds_bucket"
TRANSFER = "kvcompose.transfer"


class DemoFailed(Exception):
    """The demo cannot go on; the message is one line, the log path included where it helps."""


# vLLM's server, started by `kvcompose serve`.

@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    model: str
    log: Path

    def complete(self, prompt: str, trace_id: str) -> dict[str, Any]:
        """One completion, sent in trace ``trace_id`` (a W3C traceparent, as a caller's tracer would send)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True}
        request = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(), headers={
            "Content-Type": "application/json", "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.load(response)
        except (OSError, ValueError) as error:
            raise DemoFailed(f"the completion failed ({error}); vLLM's log: {self.log}") from None

    def metrics(self) -> tuple[str, str]:
        """The /metrics/ exposition (OpenMetrics, which carries exemplars) and its content type."""
        request = urllib.request.Request(f"{self.url}/metrics/", headers={"Accept": f"{OPENMETRICS}; version=1.0.0"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read().decode(), response.headers.get("Content-Type", "")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def serve_command(trace_url: str, model: Path, port: int) -> list[str]:
    """``kvcompose serve`` as an operator types it; ``python -m kvcompose`` runs the same entry point."""
    return ["kvcompose", "serve", "--trace", trace_url, str(PIPELINE), str(model),
            # Without this, vLLM's GPU prefix cache serves the repeat and no tier is asked to load.
            "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details",  # each answer says how many prompt tokens came from a cache
            "--enforce-eager", "--max-model-len", "512", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port)]


def start_server(command: list[str], environment: dict[str, str], model: Path, port: int, log: Path) -> Server:
    with log.open("w") as sink:
        settings = " ".join(f"{name}={shlex.quote(value)}" for name, value in environment.items())
        sink.write(f"# {settings} {shlex.join(command)}\n")
        sink.flush()
        process = subprocess.Popen([sys.executable, "-m", "kvcompose", *command[1:]], cwd=REPO, stdout=sink,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, **environment}, start_new_session=True)
    server = Server(process, f"http://127.0.0.1:{port}", str(model), log)
    try:
        wait_until_healthy(server)
    except BaseException:  # Ctrl-C too: the server runs in a session of its own and would outlive the demo
        server.stop()
        raise
    return server


def wait_until_healthy(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise DemoFailed(f"the server exited with status {server.process.returncode} before it answered; "
                             f"see its log: {server.log}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise DemoFailed(f"vLLM's server did not answer /health within {STARTUP_TIMEOUT_S:.0f} s; "
                     f"see its log: {server.log}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Waiting for both sides to report: the spans of every transfer, and the metrics counting the same transfers.

def transfer_spans(spans: list[ReceivedSpan]) -> Counter[tuple[str, str]]:
    """Transfer spans by (tier, direction)."""
    return Counter((span.attributes.get("kvcompose.connector.name"), span.attributes.get(f"{TRANSFER}.direction"))
                   for span in spans if span.name.startswith(f"{TRANSFER} "))


def settled(traces: list[list[ReceivedSpan]], scrape: Scrape, tiers: list[str]) -> bool:
    """Every request's spans are in, and /metrics/ counts as many lookups and transfers as the spans show."""
    for trace in traces:
        requests = [span for span in trace if span.name == "kvcompose.request"]
        if not requests or all(span.service == "kvcompose" for span in trace):  # vLLM's own span is not in yet
            return False
        # The request span sums up its transfers per tier (kvcompose.tier.<tier>.<direction>_bytes): each has a span.
        summarized = {tuple(key.removesuffix("_bytes").split(".")[2:4])
                      for request in requests for key in request.attributes
                      if key.startswith("kvcompose.tier.") and key.endswith("_bytes")}
        if any(transfer_spans(trace)[transfer] == 0 for transfer in summarized):
            return False
    shipped = transfer_spans([span for trace in traces for span in trace])
    return all(scrape.total("kvcompose_lookups_total", connector=tier) == len(traces)
               and all(scrape.total(LIFETIME_COUNT, connector=tier, direction=direction) == shipped[(tier, direction)]
                       for direction in ("load", "save"))
               for tier in tiers)


# What the demo prints.

def tier_table(scrape: Scrape) -> list[str]:
    """Each tier's transfers as `kvcompose top` reads them (its frame and cells), with totals instead of rates."""
    lines = [f"  {'tier':<8} {'':<4} {'hits':>4} {'transfers':>9}  {'copy p50/p99':<16} {'lifetime p50/p99':<16} bytes"]
    for row in frame(scrape, scrape).rows:
        shown = dict(zip(COLUMNS, cells(row), strict=True))
        hits = f"{scrape.total('kvcompose_lookups_total', connector=row.name, result='hit'):.0f}/" \
               f"{scrape.total('kvcompose_lookups_total', connector=row.name):.0f}"
        for direction in ("load", "save"):
            labels = {"connector": row.name, "direction": direction}
            lines.append(f"  {row.name:<8} {direction:<4} {hits if direction == 'load' else '':>4} "
                         f"{scrape.total(LIFETIME_COUNT, **labels):>9.0f}  {shown[f'{direction} copy p50/p99']:<16} "
                         f"{shown[f'{direction} life p50/p99']:<16} "
                         f"{scrape.total('kvcompose_transfer_bytes_total', **labels):,.0f}")
    return lines


def exemplar_trace(scrape: Scrape, tier: str, direction: str) -> str | None:
    """The trace id the newest exemplar of ``tier``'s ``direction`` transfers points to."""
    exemplars = [sample.exemplar for sample in scrape.series(LIFETIME_BUCKET, connector=tier, direction=direction)
                 if sample.exemplar is not None]
    newest = max(exemplars, key=lambda exemplar: exemplar.timestamp or 0, default=None)
    return newest.labels.get("trace_id") if newest else None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def label(span: ReceivedSpan) -> str:
    if span.service != "kvcompose":
        return f"{span.name} ({span.service})"
    tier = span.attributes.get("kvcompose.connector.name")
    return span.name if tier is None or span.name.startswith(f"{TRANSFER} ") else f"{span.name} {tier}"


def detail(span: ReceivedSpan) -> str:
    attributes = span.attributes
    if span.name == "kvcompose.request":
        loaded = attributes.get("kvcompose.tokens.loaded")
        return f"{loaded} tokens loaded from {attributes.get('kvcompose.load.connector')}" if loaded else "no load"
    if span.name == "kvcompose.lookup":
        return f"{attributes.get('kvcompose.tokens.matched', 0)} tokens matched"
    if span.name.startswith(f"{TRANSFER} "):
        copy = attributes.get(f"{TRANSFER}.copy_seconds")
        return f"{attributes.get(f'{TRANSFER}.bytes', 0):,} B" + (f", copy {_ms(copy)}" if copy is not None else "")
    return ""


def waterfall(spans: list[ReceivedSpan]) -> list[str]:
    """The spans as rows of offset, duration, a bar on the trace's time line, and what each moved."""
    spans = sorted(spans, key=lambda span: (span.start_ns, -span.end_ns))
    first, last = spans[0].start_ns, max(span.end_ns for span in spans)
    scale = BAR_WIDTH / max(last - first, 1)
    width = max(len(label(span)) for span in spans)
    lines = [f"  {'span':<{width}} {'start':>9} {'duration':>9}  |0{_ms((last - first) / 1e9):>{BAR_WIDTH - 1}}|"]
    for span in spans:
        offset = min(int((span.start_ns - first) * scale), BAR_WIDTH - 1)
        length = min(max(1, round((span.end_ns - span.start_ns) * scale)), BAR_WIDTH - offset)
        bar = " " * offset + "#" * length
        lines.append(f"  {label(span):<{width}} {'+' + _ms((span.start_ns - first) / 1e9):>9} {_ms(span.seconds):>9}  "
                     f"|{bar:<{BAR_WIDTH}}| {detail(span)}")
    return lines


def display(path: Path) -> str:
    """``path`` as the operator would type it: relative to the checkout, or with ~ for the home directory."""
    if path.is_relative_to(REPO):
        return str(path.relative_to(REPO))
    return f"~/{path.relative_to(Path.home())}" if path.is_relative_to(Path.home()) else str(path)


def shown_command(command: list[str], model: Path) -> str:
    """``command`` as a shell line, broken after the model into two."""
    words = [display(model) if arg == str(model) else shlex.quote(arg) for arg in command]
    split = command.index(str(model)) + 1
    return f"$ {' '.join(words[:split])} \\\n    {' '.join(words[split:])}"


def run(workdir: Path, receiver: SpanReceiver, started: float) -> None:
    model = ensure_tiny_model()
    port = free_port()
    log = workdir / "vllm.log"
    offload_bytes = os.environ.get("KVCOMPOSE_OFFLOAD_BYTES", OFFLOAD_BYTES)
    environment = {"KVCOMPOSE_OFFLOAD_BYTES": offload_bytes, "KVCOMPOSE_DISK": str(workdir / "disk"),
                   "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "OTEL_BSP_SCHEDULE_DELAY": "200"}  # vLLM batches its spans for 5 s by default
    command = serve_command(receiver.url, model, port)
    print(f"kvcompose demo: vLLM's OpenAI server on the CPU, a tiny random-weight model, {PIPELINE}:")
    print(f"  tier offload: vLLM's OffloadingConnector on kvcompose's CPU spec, "
          f"KVCOMPOSE_OFFLOAD_BYTES={offload_bytes} bytes of RAM")
    print(f"  tier disk:    vLLM's ExampleConnector, files under {environment['KVCOMPOSE_DISK']}")
    print(shown_command(command, model))
    print("  (prefix caching off, else vLLM's GPU prefix cache serves the repeat and no tier loads)")
    print(f"vLLM's log: {log} (spans.json, metrics.txt beside it); starting ...", end="", flush=True)
    try:
        server = start_server(command, environment, model, port, log)
    except BaseException:
        print(" failed", flush=True)  # ends the line; the reason follows on stderr
        raise
    ready = time.monotonic()
    traces = [secrets.token_hex(16), secrets.token_hex(16)]  # one trace per request, as a caller's tracer sends
    try:
        print(f" ready after {ready - started:.1f} s", flush=True)
        send_requests(server, traces)
        answered = time.monotonic()
        text, scrape = wait_until_settled(server, receiver, traces)
        (workdir / "metrics.txt").write_text(text)
        (workdir / "spans.json").write_text(json.dumps([asdict(span) for span in receiver.spans()], indent=1))
    finally:
        stopping = time.monotonic()
        server.stop()
        stopped = time.monotonic() - stopping

    print(f"tiers, from {server.url}/metrics/ as `kvcompose top --once` reads it (totals since the server started):")
    for line in tier_table(scrape):
        print(line)
    shown_trace = exemplar_trace(scrape, "offload", "load")
    if shown_trace is None:
        raise DemoFailed(f"the repeat loaded nothing from the offload tier; see vLLM's log: {log}")
    request = next((number for number, trace_id in enumerate(traces, 1) if trace_id == shown_trace), "?")
    print(f"trace {shown_trace} (request {request}), named by the offload load's exemplar on /metrics/:")
    for line in waterfall(receiver.spans(shown_trace)):
        print(line)
    print(f"done in {time.monotonic() - started:.1f} s: server start {ready - started:.1f} s, requests "
          f"{answered - ready:.1f} s, waiting for spans and metrics {stopping - answered:.1f} s, "
          f"shutdown {stopped:.1f} s")


def send_requests(server: Server, traces: list[str]) -> None:
    """The prompt once per trace: the first is computed and stored, the repeats are served by a tier."""
    for number, trace_id in enumerate(traces, 1):
        sent = time.monotonic()
        usage = server.complete(PROMPT, trace_id)["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        print(f"request {number}: {'the same prompt again' if number > 1 else 'first sight'}: {cached} of "
              f"{usage['prompt_tokens']} prompt tokens from a tier (vLLM's count), {_ms(time.monotonic() - sent)}",
              flush=True)


def wait_until_settled(server: Server, receiver: SpanReceiver, traces: list[str]) -> tuple[str, Scrape]:
    """The /metrics/ exposition once it and the received spans tell of the same transfers (or the time is up)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        try:
            text, content_type = server.metrics()
            scrape = parse(text, content_type, time.monotonic())
            tiers = [row.name for row in frame(scrape, scrape).rows]
        except (OSError, ValueError, ScrapeError) as error:
            raise DemoFailed(f"cannot read {server.url}/metrics/ ({error}); see vLLM's log: {server.log}") from None
        if settled([receiver.spans(trace_id) for trace_id in traces], scrape, tiers):
            return text, scrape
        if time.monotonic() > deadline:
            print(f"(spans and /metrics/ had not settled after {SETTLE_TIMEOUT_S:.0f} s: figures may be partial)")
            return text, scrape
        time.sleep(0.2)


def main() -> int:
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="kvcompose-demo-"))
    receiver = SpanReceiver()
    try:
        run(workdir, receiver, started)
    except DemoFailed as failure:
        print(f"kvcompose demo: {failure}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # whoever read the output left (`make demo | head`); the server is already stopped
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail again
        return 1
    finally:
        receiver.stop()
        shutil.rmtree(workdir / "disk", ignore_errors=True)  # the log, spans and metrics stay
    return 0


if __name__ == "__main__":
    sys.exit(main())
