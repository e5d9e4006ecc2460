"""kvcompose's series in Prometheus multiprocess mode: `vllm serve --api-server-count 2`.

With more than one API server, vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` (or
keeps the user's, as here) and every API server process writes its metric
values to files there; /metrics, whichever process answers it, adds them up.
The engine hands each step's stats to one API server (one with outputs in
that step), so each process holds part of kvcompose's counts. Counters and
histograms add up across processes; a gauge needs a ``multiprocess_mode``,
else each process's value is a separate series with a ``pid`` label.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from kvcompose.config import load_pipeline
from kvcompose.exposition import read
from kvcompose.render import kv_transfer_config
from kvcompose.testing.tiny_model import prompt_words

from .prometheus_support import wait

pytestmark = pytest.mark.engine

API_SERVERS = 2
PROMPTS = [prompt_words(seed=60 + i, length=96) for i in range(4)]
MAX_REQUESTS = 40  # repeats until both API servers have recorded lookups
WORKER_OPS = ("start_load_kv", "wait_for_save", "get_transfer_results", "get_block_ids_with_load_errors")


@pytest.fixture(scope="module")
def multi_api_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from .server_support import start_server

    root = tmp_path_factory.mktemp("multiproc")
    pipeline = {
        "version": 1, "name": "multiproc",
        "children": [
            {"name": name, "connector": "ExampleConnector", "config": {"shared_storage_path": str(root / name)}}
            for name in ("hot", "cold")
        ],
    }
    (root / "prometheus").mkdir()
    server = start_server(
        tiny_model, json.dumps(kv_transfer_config(load_pipeline(pipeline), pipeline)), root / "server.log",
        env={"PROMETHEUS_MULTIPROC_DIR": str(root / "prometheus")},
        extra_args=["--api-server-count", str(API_SERVERS)], module="tests.serve_command",
    )
    server.prometheus_dir = root / "prometheus"  # type: ignore[attr-defined]
    yield server
    server.stop()


def _samples(exposition: str) -> list[Any]:
    """kvcompose's samples."""
    return [sample for samples in read(exposition).samples.values() for sample in samples]


def _lookups(exposition: str) -> dict[tuple[str, str], float]:
    """(child, result) -> count."""
    counts: dict[tuple[str, str], float] = defaultdict(float)
    for sample in read(exposition).series("kvcompose_lookups_total"):
        counts[(sample.labels["connector"], sample.labels["result"])] += sample.value
    return dict(counts)


def _durations(exposition: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(child, op) -> {"buckets": [(le, cumulative count)], "count": _count, "sum": _sum}."""
    series: dict[tuple[str, str], dict[str, Any]] = defaultdict(lambda: {"buckets": []})
    for sample in _samples(exposition):
        if sample.name.startswith("kvcompose_call_duration_seconds"):
            row = series[(sample.labels["connector"], sample.labels["op"])]
            suffix = sample.name.removeprefix("kvcompose_call_duration_seconds_")
            if suffix == "bucket":
                row["buckets"].append((float(sample.labels["le"]), sample.value))
            else:
                row[suffix] = sample.value
    return dict(series)


def _per_process_expositions(directory: Path, scratch: Path) -> dict[str, str]:
    """What each process wrote to the multiprocess directory, read on its own."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    expositions = {}
    for pid in sorted({path.stem.rsplit("_", 1)[1] for path in directory.glob("*.db")}):
        own = scratch / pid
        own.mkdir(parents=True)
        for path in directory.glob(f"*_{pid}.db"):
            shutil.copy(path, own)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(own))
        expositions[pid] = generate_latest(registry).decode()
    return expositions


def _external_hits(exposition: str) -> float:
    return read(exposition, ("vllm:",)).total("vllm:external_prefix_cache_hits_total")


def test_series_add_up_across_api_server_processes(multi_api_server: Any, tmp_path: Path) -> None:
    server = multi_api_server
    texts = [server.complete(prompt)["choices"][0]["text"] for prompt in PROMPTS]  # misses; saved to both
    sent = len(PROMPTS)

    def processes_with_lookups() -> int:
        per_process = _per_process_expositions(server.prometheus_dir, tmp_path / f"scan-{sent}")
        return sum(1 for exposition in per_process.values() if _lookups(exposition))

    while sent < 2 * len(PROMPTS) or (processes_with_lookups() < API_SERVERS and sent < MAX_REQUESTS):
        index = sent % len(PROMPTS)
        assert server.complete(PROMPTS[index])["choices"][0]["text"] == texts[index]  # loaded from hot
        sent += 1
    hits = sent - len(PROMPTS)
    expected_lookups = {(child, result): count for child in ("hot", "cold")
                        for result, count in (("hit", hits), ("miss", len(PROMPTS)))}

    def settled() -> bool:  # the last step's stats reach /metrics after the response
        exposition = server.metrics()
        durations = _durations(exposition)
        steps = durations.get(("hot", "build_connector_meta"), {}).get("count")
        return (_lookups(exposition) == expected_lookups
                and all(durations.get((child, op), {}).get("count") == steps
                        for child in ("hot", "cold") for op in WORKER_OPS))

    wait(settled, 30, lambda: server.metrics())
    exposition = server.metrics()
    ours = _samples(exposition)
    assert ours and not [s for s in ours if "pid" in s.labels]  # nothing of ours is split per process

    # The pipeline's children, once each: the gauge's multiprocess_mode merged the processes' values.
    info = [s for s in ours if s.name == "kvcompose_pipeline_info"]
    assert sorted((s.labels["connector"], s.labels["position"], s.value) for s in info) == [
        ("cold", "1", 1.0), ("hot", "0", 1.0)]

    # Counters: every request looked up once per child, the sum over processes.
    assert _lookups(exposition) == expected_lookups
    per_process = _per_process_expositions(server.prometheus_dir, tmp_path / "final")
    contributions = [_lookups(text) for text in per_process.values() if _lookups(text)]
    assert len(contributions) == API_SERVERS, per_process.keys()
    assert {key: sum(c.get(key, 0.0) for c in contributions) for key in expected_lookups} == expected_lookups
    loaded = {s.labels["connector"]: s.value for s in ours if s.name == "kvcompose_loaded_tokens_total"}
    assert loaded["hot"] == _external_hits(exposition) > 0  # agrees with vLLM's own series
    assert loaded.get("cold", 0.0) == 0.0

    # Histograms: cumulative buckets, +Inf equals _count, one lookup per request per child.
    durations = _durations(exposition)
    for (child, op), row in durations.items():
        buckets = sorted(row["buckets"])
        counts = [count for _, count in buckets]
        assert counts == sorted(counts), (child, op)
        assert buckets[-1][0] == float("inf") and counts[-1] == row["count"], (child, op)
        assert row["sum"] > 0, (child, op)
    for child in ("hot", "cold"):
        assert durations[(child, "lookup")]["count"] == sent
        steps = durations[(child, "build_connector_meta")]["count"]
        assert all(durations[(child, op)]["count"] == steps for op in WORKER_OPS)  # one worker

    lines = "\n".join(line for line in exposition.splitlines() if "kvcompose_" in line) + "\n"
    lint = subprocess.run(["promtool", "check", "metrics"], input=lines, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
