"""KVComposeConnector behind `vllm serve` and its OpenAI completions endpoint."""

from __future__ import annotations

import re
import shutil
from typing import Any

import pytest

from kvcompose.testing.tiny_model import prompt_words

pytestmark = pytest.mark.engine

PROMPT = prompt_words(seed=2, length=96)


def _external_hits(metrics: str) -> float:
    found = re.findall(r'^vllm:external_prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$', metrics, re.M)
    return sum(float(v) for v in found)


def test_completions_save_to_both_and_load_on_repeat(served_pipeline: Any, plain_llm: Any) -> None:
    from .engine_support import greedy

    expected = plain_llm.generate([PROMPT], greedy(), use_tqdm=False)[0].outputs[0].text
    server = served_pipeline
    first = server.complete(PROMPT)["choices"][0]["text"]
    assert first == expected
    hot, cold = server.stores["hot"], server.stores["cold"]
    saved = sorted(p.relative_to(hot) for p in hot.rglob("*.safetensors"))
    assert saved and saved == sorted(p.relative_to(cold) for p in cold.rglob("*.safetensors"))

    hits_before = _external_hits(server.metrics())
    assert server.complete(PROMPT)["choices"][0]["text"] == expected
    hits_after_hot = _external_hits(server.metrics())
    assert hits_after_hot > hits_before, server.log_tail()

    shutil.rmtree(hot)
    assert server.complete(PROMPT)["choices"][0]["text"] == expected
    assert _external_hits(server.metrics()) > hits_after_hot


def _samples(metrics: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == name:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine")))
                found[labels] = sample.value
    return found


def test_metrics_show_each_child(served_pipeline: Any) -> None:
    """After the completions above: hot served one load, cold one (and saw two hits)."""
    import subprocess
    import time

    deadline = time.monotonic() + 20
    while True:
        metrics = served_pipeline.metrics()
        lookups = _samples(metrics, "kvcompose_lookups_total")
        if lookups.get((("connector", "cold"), ("result", "hit")), 0) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert lookups[(("connector", "hot"), ("result", "hit"))] == 1
    assert lookups[(("connector", "hot"), ("result", "miss"))] == 2
    assert lookups[(("connector", "cold"), ("result", "hit"))] == 2
    assert lookups[(("connector", "cold"), ("result", "miss"))] == 1
    loaded = _samples(metrics, "kvcompose_loaded_tokens_total")
    assert loaded[(("connector", "hot"),)] == loaded[(("connector", "cold"),)] > 0
    saves = _samples(metrics, "kvcompose_call_duration_seconds_count")
    for child in ("hot", "cold"):
        assert saves[(("connector", child), ("op", "wait_for_save"))] > 0
        assert (("connector", child), ("op", "save_kv_layer")) not in saves  # per-layer timing is opt-in
        assert saves[(("connector", child), ("op", "lookup"))] == 3
    info = _samples(metrics, "kvcompose_pipeline_info")
    assert info == {
        (("connector", "hot"), ("connector_class", "ExampleConnector"), ("pipeline", "hot-then-cold"),
         ("position", "0")): 1.0,
        (("connector", "cold"), ("connector_class", "ExampleConnector"), ("pipeline", "hot-then-cold"),
         ("position", "1")): 1.0,
    }
    ours = "\n".join(line for line in metrics.splitlines() if "kvcompose_" in line) + "\n"
    lint = subprocess.run(["promtool", "check", "metrics"], input=ours, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
