"""The operator guides, walked as written: README.md's Quickstart, its safe form of `kvcompose render`, and
examples/observability/README.md.

The commands are read from the guides' ```bash blocks (and the few the observability guide gives in its
prose, :data:`PROSE`) when the tests run, so an edited guide is walked again. Each runs in bash as the guide
writes it, except for what cannot run here: :data:`SUBSTITUTIONS` replaces the placeholders and addresses,
:func:`serve_options` adds the CPU options every test server needs to ``kvcompose serve``, and
:data:`NOT_TESTABLE` names the commands that are not run, with the reason. curl runs as itself: it is on
these machines (the first test fails, naming it, when a program a guide calls is missing). Then what each
guide promises is checked against the server's /metrics and the spans a receiver got.

The Quickstart's ``make demo`` is walked by tests/test_demo.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kvcompose.testing.otlp_receiver import ReceivedSpan, SpanReceiver
from kvcompose.testing.tiny_model import prompt_words
from kvcompose.top import COLUMNS

from .served_tracing import metric_value
from .server_support import free_port, launch, server_options

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
OBSERVABILITY = REPO / "examples" / "observability" / "README.md"
FENCED_BASH = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
EXEMPLAR = "# {trace_id="
PROMPT_WORDS = 300  # "a prompt of a few hundred words": two whole 128-token blocks on the CPU build


@dataclass(frozen=True)
class Here:
    """What this machine puts where the guides have placeholders."""

    model: Path
    port: int
    collector: str  # the receiver's base URL
    prompt: str


# (as the guides write it, what runs here, why)
SUBSTITUTIONS: tuple[tuple[str, Callable[[Here], str], str], ...] = (
    ("MODEL", lambda here: str(here.model), "your model: the tiny local one (no model hub is reachable here)"),
    ("localhost:8000", lambda here: f"localhost:{here.port}", "port 8000: a free port (test servers run side by side)"),
    ("--port 8000", lambda here: f"--port {here.port}", "port 8000: the same free port"),
    ('"..."', lambda here: json.dumps(here.prompt), f"a prompt of a few hundred words: {PROMPT_WORDS} of the model's"),
    ("http://localhost:4318", lambda here: here.collector,
     "the OTLP collector (Jaeger): a SpanReceiver (kvcompose.testing.otlp_receiver) on a port of its own"),
)
LEFT_OVER = re.compile(r"\bMODEL\b|\.\.\.|:8000\b|:4318\b")  # a placeholder or address the substitutions missed
NOT_TESTABLE = {"docker compose": "it runs Prometheus, Grafana and Jaeger in containers: these machines have no Docker"}
IN_BACKGROUND = "kvcompose serve"  # it becomes vLLM's server, which runs until stopped
# The pipelines' stores, under the test's temp dir: their defaults under /tmp/kvcompose are shared with every
# other run, whose files would answer the lookups.
STORES = {"KVCOMPOSE_DISK": "disk", "KVCOMPOSE_HOT": "hot", "KVCOMPOSE_COLD": "cold"}
NO_PREFIX_CACHING = "--no-enable-prefix-caching"
# Commands the observability guide gives in its prose; each must still stand there, in backquotes.
PROSE = ("curl localhost:8000/metrics/",
         "kvcompose dashboard --pipeline my-pipeline.yaml --output dashboards/my-pipeline.json")


def section(text: str, heading: str) -> str:
    """``text`` from the line ``heading`` to the next second-level heading."""
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def bash_blocks(text: str) -> list[list[str]]:
    """The commands of each ```bash block, a line continued with a backslash joined to the next."""
    return [[line for line in re.sub(r"\\\n\s*", "", block).splitlines() if line.strip()]
            for block in FENCED_BASH.findall(text)]


# README.md's bash blocks outside the Quickstart: each walked by a test here, or named with why it is not.
README_BLOCKS = {
    "## Install": "pip installs from a package index (tests/test_packaging.py builds and installs this checkout)",
    "## Assembling `vllm serve` yourself": "walked: test_the_safe_render_form_starts_vllm_only_with_a_valid_pipeline",
}


def quickstart() -> list[list[str]]:
    return bash_blocks(section(README.read_text(), "## Quickstart"))


def observability() -> list[list[str]]:
    return bash_blocks(OBSERVABILITY.read_text())


def prose(command: str) -> str:
    assert f"`{command}`" in OBSERVABILITY.read_text(), f"the observability guide no longer shows `{command}`"
    return command


def not_testable(command: str) -> str | None:
    """Why ``command`` is not run here, or None."""
    return next((why for start, why in NOT_TESTABLE.items() if command.startswith(start)), None)


def substituted(command: str, here: Here) -> str:
    for written, replacement, _ in SUBSTITUTIONS:
        command = command.replace(written, replacement(here))
    return command


def serve_options(port: int, command: list[str]) -> list[str]:
    """The options every test server runs with (loopback, the tiny model's CPU settings) that ``command``
    lacks; never --no-enable-prefix-caching, so that only the guide's own can make a tier load."""
    groups: list[list[str]] = []
    for word in server_options(port):
        if word.startswith("--"):
            groups.append([word])
        else:
            groups[-1].append(word)
    return [word for group in groups if group[0] not in command and group[0] != NO_PREFIX_CACHING for word in group]


def guide_env(root: Path) -> dict[str, str]:
    """This checkout's ``kvcompose`` first on PATH and first to import (the venv's editable install may
    point at another checkout), and the stores under ``root``."""
    return {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **{name: str(root / store) for name, store in STORES.items()}}


def programs(command: str) -> list[str]:
    """The programs a shell line calls: the first word of each pipeline stage and command substitution."""
    return re.findall(r"(?:^|\||\$\()\s*([\w.-]+)", command)


def test_every_guide_command_runs_here_or_is_named() -> None:
    """The guides' commands, after the substitutions: no placeholder left, every program they call installed."""
    here = Here(Path("/model"), 1234, "http://127.0.0.1:4321", "w3 w4")
    commands = [*(line for block in quickstart() + observability() for line in block), *map(prose, PROSE)]
    assert any(line.startswith(IN_BACKGROUND) for line in commands), commands
    for command in commands:
        if not_testable(command):
            continue
        line = substituted(command, here)
        assert not LEFT_OVER.search(line), f"{command!r} runs here as {line!r}: a placeholder is left"
        missing = [name for name in programs(line) if not shutil.which(name, path=guide_env(REPO)["PATH"])]
        assert not missing, f"{command!r} calls {missing}, not installed here"


def test_every_readme_bash_block_is_walked_or_named() -> None:
    """Every ```bash block of README.md is the Quickstart's or one of :data:`README_BLOCKS`."""
    text = README.read_text()
    accounted = quickstart() + [block for heading in README_BLOCKS for block in bash_blocks(section(text, heading))]
    assert sorted(map(tuple, bash_blocks(text))) == sorted(map(tuple, accounted))


@pytest.mark.parametrize("valid", [True, False], ids=["valid", "invalid"])
def test_the_safe_render_form_starts_vllm_only_with_a_valid_pipeline(valid: bool, tmp_path: Path) -> None:
    """README's safe form, run in bash as written, with a stand-in `vllm` that records its arguments: a valid
    pipeline reaches vLLM as exactly what `kvcompose render` prints; an invalid one stops the script (exit 2)
    before vLLM starts, where the inline form would start vLLM with an empty config."""
    [block] = bash_blocks(section(README.read_text(), "## Assembling `vllm serve` yourself"))
    shutil.copy(OBSERVABILITY.parent / "pipeline.yaml", tmp_path / "p.yaml")
    if not valid:
        (tmp_path / "p.yaml").write_text((tmp_path / "p.yaml").read_text().replace("version: 1", "version: 7"))
    stand_in = tmp_path / "bin" / "vllm"
    stand_in.parent.mkdir()
    stand_in.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$(dirname "$0")/argv"\n')
    stand_in.chmod(0o755)
    env = {**os.environ, **guide_env(tmp_path)}
    env["PATH"] = f"{stand_in.parent}{os.pathsep}{env['PATH']}"
    result = subprocess.run(["bash", "-c", "\n".join(block)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=60)
    argv = stand_in.parent / "argv"
    if not valid:
        assert result.returncode == 2 and "version" in result.stderr, result.stderr
        assert not argv.exists()
        return
    assert result.returncode == 0, result.stderr
    rendered = subprocess.run(["kvcompose", "render", "p.yaml"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, check=True).stdout.strip()
    assert argv.read_text().splitlines() == ["serve", "MODEL", "--kv-transfer-config", rendered]


def test_the_dashboard_command_writes_a_row_per_child(tmp_path: Path) -> None:
    """`kvcompose dashboard --pipeline my-pipeline.yaml ...` with the guide's pipeline as the reader's."""
    shutil.copy(OBSERVABILITY.parent / "pipeline.yaml", tmp_path / "my-pipeline.yaml")
    (tmp_path / "dashboards").mkdir()  # the repository's, where the guide's kvcompose.json is
    command = prose(PROSE[1])
    result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env={**os.environ, **guide_env(tmp_path)},
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    dashboard = json.loads((tmp_path / "dashboards" / "my-pipeline.json").read_text())
    rows = [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"]
    children = yaml.safe_load((tmp_path / "my-pipeline.yaml").read_text())["children"]
    assert {f"{child['name']} ({child['connector']})" for child in children} <= set(rows), rows


@dataclass
class Walk:
    """What a guide's commands did here: each as the guide writes it with its result here, those not run
    with why, then the server's /metrics and every span the receiver got."""

    ran: list[tuple[str, subprocess.CompletedProcess[str]]]
    not_run: list[tuple[str, str]]
    metrics: str
    spans: list[ReceivedSpan]
    root: Path

    def outputs(self, start: str) -> list[str]:
        """The standard output of each command run whose written form starts with ``start``."""
        return [result.stdout for command, result in self.ran if command.startswith(start)]


def walk(steps: list[str], model: Path, cwd: Path, root: Path,
         also: dict[tuple[str, str], int] | None = None) -> Walk:
    """Run ``steps`` in ``cwd`` as :data:`SUBSTITUTIONS` says, the server in the background; stop the server
    once every completion's request spans of both sides arrived, and the spans ``also`` counts (each process
    of an engine exports its own: a worker's transfer spans may come after the scheduler's)."""
    receiver = SpanReceiver()
    here = Here(model, free_port(), receiver.url, prompt_words(seed=7, length=PROMPT_WORDS))
    env = {**os.environ, **guide_env(root)}
    ran: list[tuple[str, subprocess.CompletedProcess[str]]] = []
    not_run, server = [], None
    try:
        for command in steps:
            if why := not_testable(command):
                not_run.append((command, why))
                continue
            line = substituted(command, here)
            if line.startswith(IN_BACKGROUND):
                words = shlex.split(line)
                with pytest.MonkeyPatch.context() as patch:  # launch starts it in this process's directory
                    patch.chdir(cwd)
                    server = launch([*words, *serve_options(here.port, words)], here.port, model, root / "server.log",
                                    env)
                continue
            result = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True,
                                    timeout=120)
            assert result.returncode == 0, f"{command}\nran here as: {line}\n{result.stdout[-2000:]}{result.stderr}"
            ran.append((command, result))
        assert server is not None, f"no `{IN_BACKGROUND}` among {steps}"
        completions = sum("/v1/completions" in command for command, _ in ran)
        both_sides = {("vllm", "llm_request"): completions, ("kvcompose", "kvcompose.request"): completions}
        spans = received(receiver, {**both_sides, **(also or {})})
        return Walk(ran, not_run, server.metrics(), spans, root)
    finally:
        if server is not None:
            server.stop()
        receiver.stop()


def received(receiver: SpanReceiver, expected: dict[tuple[str, str], int], seconds: float = 60) -> list[ReceivedSpan]:
    """The receiver's spans once it holds ``expected`` of each (service, name), or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        spans = receiver.spans()
        counts = {key: sum((span.service, span.name) == key for span in spans) for key in expected}
        if counts == expected or time.monotonic() > deadline:
            return spans
        time.sleep(0.5)


# README.md's Quickstart: the offload starter, traced, a prompt sent twice, the tiers watched.

@pytest.fixture(scope="module")
def quickstart_walk(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Walk:
    root = tmp_path_factory.mktemp("quickstart")
    return walk([line for block in quickstart() for line in block], tiny_model, root, root,
                also={("kvcompose", "kvcompose.transfer load offload"): 1})


@pytest.mark.engine
def test_quickstart_pipeline_is_written_and_valid(quickstart_walk: Walk) -> None:
    assert (quickstart_walk.root / "pipeline.yaml").is_file()
    [validated] = quickstart_walk.outputs("kvcompose validate")
    assert validated.startswith("ok: pipeline 'offload-then-disk', 2 children (offload, disk)"), validated
    assert quickstart_walk.not_run == []


@pytest.mark.engine
def test_quickstart_repeat_loads_from_the_offload_tier(quickstart_walk: Walk) -> None:
    """The first request saves to both tiers, the second loads from `offload`: vLLM counts as many prompt
    tokens from the connector as kvcompose says the offload tier loaded."""
    answers = [json.loads(out) for out in quickstart_walk.outputs("curl")]
    assert [answer["usage"]["prompt_tokens"] >= PROMPT_WORDS for answer in answers] == [True, True], answers
    metrics = quickstart_walk.metrics
    loaded = metric_value(metrics, "kvcompose_loaded_tokens_total", connector="offload")
    assert loaded > 0, metrics[-3000:]
    assert metric_value(metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == loaded
    assert metric_value(metrics, "kvcompose_loaded_tokens_total", connector="disk") == 0  # offload had it first
    assert any((quickstart_walk.root / "disk").iterdir())  # and the disk tier saved it too


@pytest.mark.engine
def test_quickstart_top_shows_the_load(quickstart_walk: Walk) -> None:
    """`kvcompose top --once`: the offload tier hit one lookup of two, and its load's copy time and lifetime."""
    [frame] = quickstart_walk.outputs("kvcompose top")
    rows = {words[0]: words for words in map(str.split, frame.splitlines()) if words}
    offload = rows["offload"]
    assert offload[COLUMNS.index("hit")] == "50%", frame
    for column in ("load copy p50/p99", "load life p50/p99"):
        assert re.fullmatch(r"[\d.]+(us|ms|s)/[\d.]+(us|ms|s)", offload[COLUMNS.index(column)]), (column, frame)


@pytest.mark.engine
def test_quickstart_traces_both_sides(quickstart_walk: Walk) -> None:
    """--trace: each request's spans from vLLM (service "vllm") and kvcompose (service "kvcompose") reach the
    collector, the repeat's load from `offload` among them. The Quickstart's requests carry no traceparent:
    kvcompose serve's shared-trace middleware gives each one, so each request is one trace of both sides."""
    spans = quickstart_walk.spans
    requests = Counter((span.service, span.name) for span in spans if span.name in ("llm_request", "kvcompose.request"))
    assert requests == {("vllm", "llm_request"): 2, ("kvcompose", "kvcompose.request"): 2}, requests
    assert {span.service for span in spans} == {"vllm", "kvcompose"}
    assert {span.service for span in spans if span.name == "kvcompose.transfer load offload"} == {"kvcompose"}
    # The requests' traces (vLLM also traces its own start-up, in a trace of its own).
    requests_traces = {span.trace_id for span in spans if span.name in ("llm_request", "kvcompose.request")}
    services: dict[str, set[str]] = {}
    for span in spans:
        if span.trace_id in requests_traces:
            services.setdefault(span.trace_id, set()).add(span.service)
    assert list(services.values()) == [{"vllm", "kvcompose"}] * 2, services


# examples/observability/README.md: its pipeline of two disk tiers, traced; the same long prompt sent twice,
# each with a traceparent of its own; the exemplars by hand.

@pytest.fixture(scope="module")
def observability_walk(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Walk:
    start, completion, exemplars = observability()
    steps = [*start, *completion, *completion, *exemplars, prose(PROSE[0])]  # "send the same long prompt twice"
    return walk(steps, tiny_model, REPO, tmp_path_factory.mktemp("observability"))


@pytest.mark.engine
def test_observability_runs_all_but_docker(observability_walk: Walk) -> None:
    assert [command.split()[:2] for command, _ in observability_walk.not_run] == [["docker", "compose"]]


@pytest.mark.engine
def test_observability_repeat_loads_from_a_tier(observability_walk: Walk) -> None:
    metrics = observability_walk.metrics
    loaded = metric_value(metrics, "kvcompose_loaded_tokens_total", connector="hot")
    assert loaded > 0, metrics[-3000:]
    assert metric_value(metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == loaded


@pytest.mark.engine
def test_observability_one_trace_per_request_both_services(observability_walk: Walk) -> None:
    """Each request's trace is its caller's (the traceparent): vLLM's llm_request (service "vllm") and
    kvcompose.request (service "kvcompose") both under the caller's span, which the receiver never got."""
    spans = observability_walk.spans
    received_ids = {span.span_id for span in spans}
    requests = {span.trace_id: span for span in spans if (span.service, span.name) == ("vllm", "llm_request")}
    ours = {span.trace_id: span for span in spans if (span.service, span.name) == ("kvcompose", "kvcompose.request")}
    assert len(requests) == 2 and set(ours) == set(requests), sorted((s.service, s.name, s.trace_id) for s in spans)
    for trace_id, request in requests.items():
        assert ours[trace_id].parent_span_id == request.parent_span_id not in received_ids


@pytest.mark.engine
def test_observability_exemplars_only_in_openmetrics(observability_walk: Walk) -> None:
    """The OpenMetrics curl's lines carry the traced requests' trace ids; the plain curl has no exemplar."""
    [openmetrics] = observability_walk.outputs("curl -s -H 'Accept: application/openmetrics-text'")
    lines = openmetrics.splitlines()
    assert lines and all(EXEMPLAR in line for line in lines), openmetrics
    traces = {span.trace_id for span in observability_walk.spans if span.name == "kvcompose.request"}
    assert {re.search(r'trace_id="([0-9a-f]+)"', line)[1] for line in lines} <= traces, (lines, traces)
    [plain] = observability_walk.outputs(PROSE[0])
    assert "kvcompose_transfer_lifetime_seconds_bucket" in plain and EXEMPLAR not in plain
