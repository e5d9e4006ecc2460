"""A real Prometheus server scrapes `vllm serve` with kvcompose; PromQL answers match /metrics."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from typing import Any

import pytest

from kvcompose.metrics.summary import summarize
from kvcompose.testing.tiny_model import prompt_words

from .prometheus_support import wait

pytestmark = pytest.mark.engine


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
    wait(lambda: query(prometheus, "sum by (connector) (kvcompose_lookups_total)") == lookups, 30,
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
