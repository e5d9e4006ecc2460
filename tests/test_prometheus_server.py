"""A real Prometheus server scrapes `vllm serve` with kvcompose; PromQL answers match /metrics."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose.metrics.summary import summarize
from kvcompose.testing.tiny_model import prompt_words

from .server_support import free_port

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def prometheus(served_pipeline: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "the Prometheus server is missing: `make test` installs it (scripts/ensure-prometheus.sh)"
    root = tmp_path_factory.mktemp("prometheus")
    target = served_pipeline.url.removeprefix("http://")
    (root / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: vllm\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    url = f"http://127.0.0.1:{free_port()}"
    with (root / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address={url.removeprefix('http://')}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200, 60,
              lambda: (root / "prometheus.log").read_text())
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _wait(ready: Any, seconds: float, explain: Any) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out after {seconds}s:\n{explain()[-3000:]}")


def query(url: str, promql: str) -> dict[str, float]:
    """Instant query; {connector label: value}."""
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}") as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return {r["metric"].get("connector", ""): float(r["value"][1]) for r in body["data"]["result"]}


def test_promql_over_scraped_series_matches_the_exposition(served_pipeline: Any, prometheus: str) -> None:
    prompt = prompt_words(seed=3, length=96)
    for _ in range(2):
        served_pipeline.complete(prompt)
    time.sleep(1)  # let the last step's stats reach /metrics
    exposition = summarize(served_pipeline.metrics())
    lookups = {child: sum(row.lookups.values()) for child, row in exposition.items()}
    _wait(lambda: query(prometheus, "sum by (connector) (kvcompose_lookups_total)") == lookups, 30,
          lambda: json.dumps(query(prometheus, "sum by (connector) (kvcompose_lookups_total)")))

    ratio = query(prometheus, 'sum by (connector) (kvcompose_lookups_total{result="hit"})'
                              " / sum by (connector) (kvcompose_lookups_total)")
    assert set(ratio) == {"hot", "cold"}
    for child, row in exposition.items():
        assert ratio[child] == pytest.approx(row.lookups["hit"] / lookups[child])
        assert 0 <= ratio[child] <= 1
    assert ratio["hot"] > 0  # the repeated prompt was served by the first child

    p90 = query(prometheus, "histogram_quantile(0.9, sum by (le, connector) "
                            '(kvcompose_call_duration_seconds_bucket{op="start_load_kv"}))')
    for child, row in exposition.items():
        assert p90[child] == pytest.approx(row.latency("start_load_kv", 0.9))
        assert p90[child] > 0
