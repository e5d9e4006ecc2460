"""KVComposeConnector behind `vllm serve` and its OpenAI completions endpoint."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
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
    before = _settled_summary(server)
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

    # Per child: hot missed, hit, missed (wiped); cold missed, then hit twice.
    after = _settled_summary(server, lambda s: s["cold"].lookups["hit"] - before["cold"].lookups["hit"] >= 2)
    delta = {c: {r: after[c].lookups[r] - before[c].lookups[r] for r in ("hit", "miss")} for c in ("hot", "cold")}
    assert delta == {"hot": {"hit": 1, "miss": 2}, "cold": {"hit": 2, "miss": 1}}
    loaded = {c: after[c].loaded_tokens - before[c].loaded_tokens for c in ("hot", "cold")}
    assert loaded["hot"] == loaded["cold"] > 0
    for child in ("hot", "cold"):
        assert after[child].calls("lookup") - before[child].calls("lookup") == 3
        assert after[child].calls("wait_for_save") > before[child].calls("wait_for_save")
        assert "save_kv_layer" not in after[child].latency_buckets  # per-layer timing is opt-in

    # Every call is timed and counted: once the engine's stats are all in, each worker step called each child
    # once per scheduler step.
    settled = _settled_summary(server, lambda s: _steps_agree(s["hot"]) and _steps_agree(s["cold"]))
    for child in ("hot", "cold"):
        counts = {op: settled[child].calls(op) for op in (*_WORKER_STEP_OPS, "build_connector_meta")}
        assert _steps_agree(settled[child]), counts


_WORKER_STEP_OPS = ("start_load_kv", "wait_for_save", "get_transfer_results", "get_block_ids_with_load_errors")


def _steps_agree(child: Any) -> bool:
    steps = child.calls("build_connector_meta")
    return steps > 0 and all(child.calls(op) == steps for op in _WORKER_STEP_OPS)


def _settled_summary(server: Any, done: Any = None) -> Any:
    """kvcompose's series per child, once the last step's stats have arrived."""
    from collections import defaultdict

    from kvcompose.metrics.summary import ChildSummary, summarize

    deadline = time.monotonic() + 20
    while True:
        summary = defaultdict(ChildSummary, summarize(server.metrics()))
        if done is None or done(summary) or time.monotonic() > deadline:
            return summary
        time.sleep(0.5)


def test_pipeline_info_and_promtool_lint(served_pipeline: Any) -> None:
    from kvcompose.exposition import read

    served_pipeline.complete(PROMPT)
    metrics = served_pipeline.metrics()
    info = {
        tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine"))): sample.value
        for sample in read(metrics).series("kvcompose_pipeline_info")
    }
    assert info == {
        (("connector", "hot"), ("connector_class", "ExampleConnector"), ("pipeline", "hot-then-cold"),
         ("position", "0")): 1.0,
        (("connector", "cold"), ("connector_class", "ExampleConnector"), ("pipeline", "hot-then-cold"),
         ("position", "1")): 1.0,
    }
    ours = "\n".join(line for line in metrics.splitlines() if "kvcompose_" in line) + "\n"
    assert "kvcompose_call_duration_seconds_bucket" in ours
    lint = subprocess.run(["promtool", "check", "metrics"], input=ours, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
