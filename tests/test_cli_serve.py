"""`kvcompose serve`: nothing starts from a bad pipeline; a good one becomes vLLM's server, traced end to end.

One real server (the `kvcompose init --offload` starter, started with
``kvcompose serve --trace``) serves the module's engine tests, `kvcompose top`'s included.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose.cli import main
from kvcompose.testing.otlp_receiver import ReceivedSpan
from kvcompose.testing.tiny_model import prompt_words
from kvcompose.top import COLUMNS

from .server_support import Server, free_port, launch, server_options
from .span_support import wait_until

REPO = Path(__file__).resolve().parents[1]
CHOSE_PLAIN = ("kvcompose: serving pipeline 'offload-then-disk' as KVComposeConnector: 'disk' (ExampleConnector) "
               "does not support vLLM's hybrid KV cache manager")


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcompose", "serve", *args], capture_output=True, text=True,
                          timeout=timeout)


def starter(tmp_path: Path, kind: str = "offload") -> Path:
    path = tmp_path / f"{kind}.yaml"
    subprocess.run([sys.executable, "-m", "kvcompose", "init", f"--{kind}", str(path)], check=True,
                   capture_output=True)
    return path


def test_an_invalid_pipeline_starts_nothing(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(starter(tmp_path).read_text().replace("${KVCOMPOSE_OFFLOAD_BYTES:-1073741824}", "abc"))
    port = free_port()
    # Run as the CLI runs, then look at what the process imported: refused before vLLM (seconds to import) or
    # torch was, so nothing of the server was started; and nothing listens on its port.
    code = ("import sys, runpy; sys.argv = ['kvcompose', 'serve', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('kvcompose', run_name='__main__')\n"
            "finally:\n    print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))\n")
    result = subprocess.run([sys.executable, "-c", code, str(path), "some-model", "--port", str(port)],
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (2, "[]\n"), result.stderr
    assert result.stderr.splitlines() == [
        f"{path}:27: children[0].config.cpu_bytes_to_use: 'abc' is not a positive integer: "
        "CPUEngineOffloadingSpec reads it with int()"]
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


@pytest.mark.parametrize(("args", "message"), [
    (["MODEL", "--trace", "http://h:4318"], "kvcompose serve: --trace is kvcompose's own option: put it before PIPELINE"),
    (["MODEL", "--kv-transfer-config", "{}"], "kvcompose serve: it sets --kv-transfer-config from PIPELINE; remove yours"),
    (["MODEL", "--kv_transfer_config.kv_role=kv_both"],
     "kvcompose serve: it sets --kv-transfer-config from PIPELINE; remove yours"),
])
def test_options_that_would_be_lost_are_refused(tmp_path: Path, args: list[str], message: str) -> None:
    result = serve(str(starter(tmp_path)), *args)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", message + "\n")


def test_trace_takes_an_otlp_http_url_and_owns_vllm_endpoint(tmp_path: Path) -> None:
    path = str(starter(tmp_path))
    result = serve("--trace", "localhost:4318", path, "MODEL")
    assert (result.returncode, result.stderr) == (
        2, "--trace localhost:4318: expected an OTLP/HTTP URL such as http://127.0.0.1:4318\n")
    result = serve("--trace", "http://h:4318", path, "MODEL", "--otlp-traces-endpoint", "http://h:4317")
    assert (result.returncode, result.stderr) == (
        2, "kvcompose serve: --trace sets vLLM's --otlp-traces-endpoint; give one or the other\n")


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[list[str], str]:
    assert main(["serve", "--dry-run", *args]) == 0
    out, err = capsys.readouterr()
    return shlex.split(out), err


def test_dry_run_shows_the_server_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    path = starter(tmp_path)
    words, err = dry_run(capsys, "--trace", "http://collector:4318", str(path), "/models/m", "--port", "8001",
                         "--max-model-len=512")
    assert err == CHOSE_PLAIN + "\n"
    config = json.loads(words[words.index("--kv-transfer-config") + 1])
    assert words[:2] == ["OTEL_SERVICE_NAME=vllm", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf"]
    assert words[2:words.index("--kv-transfer-config")] == [
        sys.executable, "-W", "ignore::DeprecationWarning:__main__", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "/models/m", "--port", "8001", "--max-model-len=512"]
    assert words[-4:] == ["--otlp-traces-endpoint", "http://collector:4318/v1/traces",
                          "--middleware", "kvcompose.shared_trace.SharedTraceMiddleware"]
    assert config["kv_connector"] == "KVComposeConnector"
    # Traced inline: the file itself is unchanged, its references still unresolved for the engine to resolve.
    pipeline = config["kv_connector_extra_config"]["pipeline"]
    assert pipeline["tracing"] == {"enabled": True, "granularity": "request", "exporter": "otlp",
                                   "endpoint": "http://collector:4318/v1/traces"}
    assert pipeline["children"][1]["config"] == {"shared_storage_path": "${KVCOMPOSE_DISK:-/tmp/kvcompose/disk}"}

    words, _ = dry_run(capsys, str(path))  # untraced: the file by path, vLLM's service name only
    config = json.loads(words[words.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["pipeline"] == str(path.resolve())
    assert words[0] == "OTEL_SERVICE_NAME=vllm" and "--otlp-traces-endpoint" not in words
    assert "kvcompose.shared_trace.SharedTraceMiddleware" not in words
    assert words[words.index("--kv-transfer-config") + 2:] == [
        "--middleware", "kvcompose.prediction_header.PredictionHeaderMiddleware"]  # a router's header, always


def test_hma_composite_when_every_child_supports_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.yaml"
    text = starter(tmp_path).read_text()
    path.write_text(text[:text.index("  - name: disk")] + text[text.index("tracing:"):])  # the offload tier alone
    words, err = dry_run(capsys, str(path), "MODEL")
    assert err == ("kvcompose: serving pipeline 'offload-then-disk' as KVComposeHMAConnector: every child supports "
                   "vLLM's hybrid KV cache manager\n")
    assert json.loads(words[words.index("--kv-transfer-config") + 1])["kv_connector"] == "KVComposeHMAConnector"


def test_a_child_whose_class_cannot_be_resolved_stops_serve(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "kvc_test_failing.py").write_text("raise ImportError('needs a library not installed here')\n"
                                                  "class Failing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nname: x\nchildren:\n"
                    "  - {name: failing, connector: Failing, module_path: kvc_test_failing}\n")
    assert main(["validate", str(path)]) == 0  # only importing it shows the failure
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--dry-run", str(path), "MODEL"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "kvcompose: child 'failing' (children[0], Failing from kvc_test_failing) failed to start: "
        "ImportError: needs a library not installed here")


# One real server for the rest of the module.

@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, otlp_receiver: Any) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("kvcompose-serve")
    pipeline = starter(root)
    port = free_port()
    command = [sys.executable, "-m", "kvcompose", "serve", "--trace", otlp_receiver.endpoint, str(pipeline),
               str(tiny_model), *server_options(port)]
    env = {"KVCOMPOSE_DISK": str(root / "disk"), "KVCOMPOSE_OFFLOAD_BYTES": str(64 << 20)}
    server = launch(command, port, tiny_model, root / "server.log", env)
    yield server
    server.stop()


def traced(server: Server, prompt: str) -> tuple[str, str]:
    """Complete ``prompt`` in a new caller trace; its trace id and the caller's span id."""
    trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
    server.complete(prompt, headers={"traceparent": f"00-{trace_id}-{caller}-01"})
    return trace_id, caller


def spans_of(receiver: Any, trace_id: str, names: set[str], seconds: float = 60) -> list[ReceivedSpan]:
    """The spans received in ``trace_id`` once ``names`` are among them (or any span is, for no names)."""
    deadline = time.monotonic() + seconds
    while True:
        spans = [span for span in receiver.spans() if span.trace_id == trace_id]
        if (spans and names <= {span.name for span in spans}) or time.monotonic() > deadline:
            return spans
        time.sleep(0.5)


@pytest.mark.engine
def test_serve_runs_the_pipeline_and_says_which_composite(served: Server) -> None:
    assert CHOSE_PLAIN in served.log.read_text(errors="replace").splitlines()
    metrics = served.metrics()
    for tier, position in (("offload", 0), ("disk", 1)):
        assert metric_total(metrics, "kvcompose_pipeline_info", pipeline="offload-then-disk", connector=tier,
                            position=str(position)) == 1, metrics[-3000:]
        assert metric_total(metrics, "kvcompose_child_state", connector=tier) == 0  # closed


@pytest.mark.engine
def test_both_sides_spans_share_the_callers_trace(served: Server, otlp_receiver: Any) -> None:
    trace_id, caller = traced(served, prompt_words(seed=41, length=200))
    spans = spans_of(otlp_receiver, trace_id, {"llm_request", "kvcompose.request"})
    by_name = {span.name: span for span in spans}
    assert {"llm_request", "kvcompose.request"} <= set(by_name), sorted((s.service, s.name) for s in spans)
    assert (by_name["llm_request"].service, by_name["kvcompose.request"].service) == ("vllm", "kvcompose")
    assert by_name["llm_request"].parent_span_id == by_name["kvcompose.request"].parent_span_id == caller
    assert not [span for span in otlp_receiver.spans() if span.service.startswith("unknown_service")]


@pytest.mark.engine
def test_a_request_without_a_traceparent_is_one_trace_too(served: Server, otlp_receiver: Any) -> None:
    """kvcompose serve --trace gives vLLM a middleware that adds a traceparent where the caller sent none: vLLM's
    llm_request and kvcompose's request span share its trace (without it, they would be two traces)."""
    known = {span.trace_id for span in otlp_receiver.spans()}
    served.complete(prompt_words(seed=47, length=200))
    both = {("vllm", "llm_request"), ("kvcompose", "kvcompose.request")}

    def shared() -> bool:
        by_trace: dict[str, set[tuple[str, str]]] = {}
        for span in otlp_receiver.spans():
            if span.trace_id not in known:
                by_trace.setdefault(span.trace_id, set()).add((span.service, span.name))
        return any(both <= names for names in by_trace.values())

    wait_until(shared, timeout_s=30)


def metric_total(metrics: str, name: str, **labels: str) -> float:
    """A series' sum over its other labels, read from the classic text format line by line."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{") and all(f'{key}="{value}"' in line for key, value in labels.items()))


@pytest.mark.engine
def test_top_once_shows_each_tier_after_traffic(served: Server, otlp_receiver: Any) -> None:
    prompt = prompt_words(seed=43, length=300)
    for _ in range(2):  # stored to both tiers, then loaded from offload
        traced(served, prompt)
    result = subprocess.run([sys.executable, "-m", "kvcompose", "top", "--once", served.url], capture_output=True,
                            text=True, timeout=60)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    rows = {words[0]: words for words in map(str.split, result.stdout.splitlines())
            if words and words[0] in ("offload", "disk")}
    assert list(rows) == ["offload", "disk"], result.stdout
    metrics = served.metrics()
    for tier, words in rows.items():
        hits = metric_total(metrics, "kvcompose_lookups_total", connector=tier, result="hit")
        lookups = metric_total(metrics, "kvcompose_lookups_total", connector=tier)
        assert hits >= 1 and words[1:3] == ["closed", f"{hits / lookups:.0%}"], (words, hits, lookups)
        assert (words[3], words[4], words[11]) == ("0", "0", "0/0")  # no traffic between its reads, none in flight
    # The transfer histograms, as p50/p99: offload's copy times are the mover's own (vLLM's kv_offload
    # stats) for its loads, with the lifetime of its loads and saves; the disk tier (which loads nothing:
    # offload has every block first) saves inside its calls, so its save copy time is those calls' duration.
    # Then offload's slowest recent transfer's trace.
    offload, disk = rows["offload"], rows["disk"]
    durations = r"[\d.]+(us|ms|s)/[\d.]+(us|ms|s)"
    assert (disk[5], disk[6]) == ("-", "-"), disk
    for words, columns in ((offload, (5, 6, 8)), (disk, (7, 8))):
        for column in columns:
            assert re.fullmatch(durations, words[column]), (COLUMNS[column], words)
    assert re.fullmatch("[0-9a-f]{32}", offload[13]), offload
    wait_until(lambda: any(span.name.startswith("kvcompose.transfer") for span in otlp_receiver.spans(offload[13])),
               timeout_s=30)  # the exporter ships every few seconds
