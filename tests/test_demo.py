"""`make demo`: about 20 lines that show a load from the offload tier, the tiers and a trace, every figure true.

The demo runs once, as `make demo` runs it, and each test reads its output.
Figures are checked against sources the demo's own rendering does not go
through: vLLM's counters in the /metrics/ exposition the demo saved
(``vllm:kv_offload_*``, written by vLLM's OffloadingConnector), vLLM's
per-request count of cached prompt tokens, the spans as received, and this
test's own clock.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
DEMO = ["examples/demo.py"]  # the recipe of `make demo`, run by the venv's python
MAX_LINES = 25
ROW = re.compile(r"^\s+(?P<tier>\w+)\s+(?P<direction>load|save)\s+(?:(?P<hits>\d+)/(?P<lookups>\d+)\s+)?"
                 r"(?P<transfers>\d+)\s+(?P<copy>\S+)\s+(?P<life>\S+)\s+(?P<bytes>[\d,]+)$")
SPAN_ROW = re.compile(r"^\s+(?P<label>\S.*?)\s+\+(?P<start>[\d.]+ \w?s)\s+(?P<duration>[\d.]+ \w?s)\s+"
                      r"\|(?P<bar>[ #]+)\|\s*(?P<detail>.*)$")
UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class DemoRun:
    stdout: str
    stderr: str
    returncode: int
    wall_s: float

    @property
    def lines(self) -> list[str]:
        return self.stdout.splitlines()

    def line(self, pattern: str) -> re.Match[str]:
        found = [match for line in self.lines if (match := re.search(pattern, line))]
        assert len(found) == 1, (pattern, self.stdout)
        return found[0]

    @property
    def directory(self) -> Path:
        return Path(self.line(r"vLLM's log: (\S+)").group(1)).parent

    def spans(self) -> list[dict[str, Any]]:
        return json.loads((self.directory / "spans.json").read_text())

    def metrics(self) -> str:
        return (self.directory / "metrics.txt").read_text()


def remove_directory(stdout: str) -> None:
    """The directory the demo named for its log (and spans, metrics): the test's to clean up."""
    if found := re.search(r"vLLM's log: (\S+)", stdout):
        shutil.rmtree(Path(found[1]).parent, ignore_errors=True)


@pytest.fixture(scope="module")
def demo() -> Iterator[DemoRun]:
    # As from an operator's shell: without conftest's VLLM_LOGGING_LEVEL, vLLM logs at its default level (INFO).
    environment = {name: value for name, value in os.environ.items() if name != "VLLM_LOGGING_LEVEL"}
    started = time.monotonic()
    result = subprocess.run([sys.executable, *DEMO], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env=environment)
    yield DemoRun(result.stdout, result.stderr, result.returncode, time.monotonic() - started)
    remove_directory(result.stdout)


def seconds(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+) ?(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(number) * UNITS[unit]


def vllm_counter(metrics: str, name: str, **labels: str) -> float:
    """A vLLM series from the exposition (OpenMetrics writes ``vllm:`` as ``vllm_``), summed over engines."""
    pattern = re.compile(rf"^vllm[:_]{name}\{{([^}}]*)\}} (\S+)", re.M)
    values = [float(value) for found, value in pattern.findall(metrics)
              if all(f'{key}="{wanted}"' in found for key, wanted in labels.items())]
    assert values, (name, labels)
    return sum(values)


def table(run: DemoRun) -> dict[tuple[str, str], re.Match[str]]:
    rows = {}
    for line in run.lines:
        if match := ROW.match(line):
            rows[(match["tier"], match["direction"])] = match
    return rows


def waterfall(run: DemoRun) -> dict[str, re.Match[str]]:
    return {match["label"]: match for line in run.lines if (match := SPAN_ROW.match(line))}


def test_make_demo_runs_the_script_this_test_runs() -> None:
    # --no-print-directory: under `make test`, a nested make would name the directory it enters and leaves.
    recipe = subprocess.run(["make", "--no-print-directory", "-n", "demo"], cwd=REPO, capture_output=True,
                            text=True, check=True)
    assert recipe.stdout.splitlines()[-1].split() == [".venv/bin/python", *DEMO]


def test_fits_about_twenty_lines_with_nothing_of_vllm_on_the_demos_own_streams(demo: DemoRun) -> None:
    assert demo.returncode == 0, demo.stderr
    assert len(demo.lines) <= MAX_LINES, demo.stdout
    assert demo.stderr == ""
    assert not re.search(r"WARNING|INFO|\(APIServer|\(EngineCore|Traceback", demo.stdout), demo.stdout
    log = Path(demo.line(r"vLLM's log: (\S+)").group(1))
    text = log.read_text()
    assert "kvcompose: serving pipeline 'offload-then-disk'" in text  # kvcompose serve started vLLM
    assert re.search(r"\(APIServer pid=\d+\) INFO .*Starting vLLM server on http://127\.0\.0\.1:\d+", text)
    assert "(EngineCore pid=" in text


def test_states_its_real_duration(demo: DemoRun) -> None:
    stated = float(demo.line(r"^done in ([\d.]+) s").group(1))
    # Measured from the demo's first statement: the interpreter's start and imports come before it, so it is
    # shorter than the test's own measure, but most of it (the server's start and the requests come after).
    assert demo.wall_s / 2 <= stated <= demo.wall_s


def test_the_repeat_is_loaded_from_the_offload_tier_as_vllm_counts_it(demo: DemoRun) -> None:
    cached = [int(match) for match in re.findall(r"^request \d: .*?: (\d+) of \d+ prompt tokens", demo.stdout, re.M)]
    assert cached[0] == 0 and cached[1] > 0, demo.stdout
    rows = waterfall(demo)
    assert rows["kvcompose.request"]["detail"] == f"{cached[1]} tokens loaded from offload", demo.stdout

    metrics = demo.metrics()
    loaded_bytes = vllm_counter(metrics, "kv_offload_total_bytes_total", connector="offload",
                                transfer_type="CPU_to_GPU")
    loaded_copy_s = vllm_counter(metrics, "kv_offload_total_time_total", connector="offload",
                                 transfer_type="CPU_to_GPU")
    load = rows["kvcompose.transfer load offload"]
    moved, copy = re.fullmatch(r"([\d,]+) B, copy (.+)", load["detail"]).groups()  # type: ignore[union-attr]
    assert int(moved.replace(",", "")) == loaded_bytes > 0
    assert math.isclose(seconds(copy), loaded_copy_s, rel_tol=5e-3), (copy, loaded_copy_s)


def test_the_saved_metrics_show_the_repeat_as_reuse(demo: DemoRun) -> None:
    """The engine is idle when the demo saves its metrics: the hit ratio by size must already count the
    repeat (the prompt's blocks referenced twice: half the references hit in a cache as large as the
    prompt), and the offload tier, which served it, wasted less than all it was written."""
    from kvcompose import exposition

    metrics = exposition.read(demo.metrics())
    curve = {int(sample.labels["size_blocks"]): sample.value
             for sample in metrics.series("kvcompose_cache_size_hit_ratio")}
    assert curve and max(curve.values()) == pytest.approx(0.5, abs=0.05), curve
    (waste,) = [sample.value for sample in metrics.series("kvcompose_write_waste_ratio")
                if sample.labels["connector"] == "offload"]
    assert waste < 1.0


def test_tier_rows_agree_with_vllms_offload_counters(demo: DemoRun) -> None:
    rows = table(demo)
    assert set(rows) == {(tier, direction) for tier in ("offload", "disk") for direction in ("load", "save")}, \
        demo.stdout
    metrics = demo.metrics()
    for direction, transfer_type in (("load", "CPU_to_GPU"), ("save", "GPU_to_CPU")):
        row = rows[("offload", direction)]
        total_s = vllm_counter(metrics, "kv_offload_total_time_total", connector="offload", transfer_type=transfer_type)
        assert int(row["bytes"].replace(",", "")) == vllm_counter(
            metrics, "kv_offload_total_bytes_total", connector="offload", transfer_type=transfer_type) > 0
        assert int(row["transfers"]) == vllm_counter(
            metrics, "kv_offload_size_count", connector="offload", transfer_type=transfer_type) == 1
        # One transfer: its p50 and p99 both lie in the histogram bucket that holds vLLM's own copy time.
        bounds = sorted({float(le) for le in re.findall(
            r'^kvcompose_transfer_copy_seconds_bucket\{[^}]*le="([^"+]+)"', metrics, re.M)})
        lower = max((bound for bound in bounds if bound < total_s), default=0.0)
        upper = min(bound for bound in bounds if bound >= total_s)
        for figure in row["copy"].split("/"):
            assert lower * 0.99 <= seconds(figure) <= upper * 1.01, (row["copy"], total_s, lower, upper)
        assert row["life"] != "-"
    cached = [int(match) for match in re.findall(r"^request \d: .*?: (\d+) of \d+", demo.stdout, re.M)]
    assert rows[("offload", "load")]["hits"] == str(sum(1 for count in cached if count)), demo.stdout
    assert rows[("offload", "load")]["lookups"] == str(len(cached))
    disk_save = rows[("disk", "save")]
    assert int(disk_save["transfers"]) >= 1 and int(disk_save["bytes"].replace(",", "")) > 0
    assert disk_save["copy"] != "-" and disk_save["life"] != "-"
    assert rows[("disk", "load")]["transfers"] == "0"  # first_match: the offload tier had the prompt first


def test_waterfall_is_the_loads_trace_as_received(demo: DemoRun) -> None:
    trace = demo.line(r"^trace ([0-9a-f]{32}) ").group(1)
    exemplars = re.findall(r'^kvcompose_transfer_lifetime_seconds_bucket\{[^}]*connector="offload"[^}]*'
                           r'direction="load"[^}]*\} \S+ # \{trace_id="([0-9a-f]{32})"\}', demo.metrics(), re.M)
    assert exemplars and set(exemplars) == {trace}
    spans = [span for span in demo.spans() if span["trace_id"] == trace]
    (load,) = [span for span in spans if span["name"] == "kvcompose.transfer load offload"]
    assert {span["service"] for span in spans} == {"vllm", "kvcompose"}  # both sides of the server, one trace

    rows = waterfall(demo)
    assert len(rows) == len(spans)
    first = min(span["start_ns"] for span in spans)
    shown = rows["kvcompose.transfer load offload"]
    assert math.isclose(seconds(shown["duration"]), (load["end_ns"] - load["start_ns"]) / 1e9, rel_tol=5e-3)
    assert math.isclose(seconds(shown["start"]), (load["start_ns"] - first) / 1e9, rel_tol=5e-3, abs_tol=1e-5)
    assert shown["bar"].strip(" ") and set(shown["bar"].strip(" ")) == {"#"}
    root = rows["llm_request (vllm)"]
    assert root["bar"] == "#" * len(root["bar"])  # vLLM's request span covers the whole trace
    assert {"kvcompose.request", "kvcompose.lookup offload", "kvcompose.lookup disk"} <= set(rows)


def test_a_server_that_cannot_start_ends_the_demo_with_one_line_naming_its_log() -> None:
    # An offload tier size that is no number: `kvcompose serve` refuses the pipeline and starts no vLLM.
    result = subprocess.run([sys.executable, *DEMO], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "KVCOMPOSE_OFFLOAD_BYTES": "abc"})
    assert result.returncode == 1
    (reason,) = result.stderr.splitlines()
    log = re.fullmatch(r"kvcompose demo: the server exited with status 2 before it answered; see its log: (\S+)",
                       reason)
    assert log, reason
    assert "cpu_bytes_to_use: 'abc' is not a positive integer" in Path(log[1]).read_text()
    assert result.stdout.splitlines()[-1].endswith("starting ... failed")
    remove_directory(result.stdout)
