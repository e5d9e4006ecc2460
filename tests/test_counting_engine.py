"""Counts stay once per request on a real engine whose KV cache is small enough to preempt requests.

vLLM preempts a running request when the KV cache runs out, frees its blocks,
and admits it again later: it looks the request up again and calls
``update_state_after_alloc`` again (as it does once an asynchronous load
completes). kvcompose counts each request's lookup once, at its first
admission, as vLLM's own external prefix-cache counters do. The children
here are real (vLLM's OffloadingConnector on kvcompose's CPU spec, which
loads asynchronously, and ExampleConnector) and write down every lookup
answer and allocation, so the test counts independently of kvcompose.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvcompose.offload import SPEC_MODULE, SPEC_NAME
from kvcompose.testing.tiny_model import prompt_words

from .counting_children import counted
from .engine_support import greedy, start_llm

pytestmark = pytest.mark.engine

REQUESTS = 4
CHILDREN = ("counted_offload", "counted_disk")


def _total(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return sum(sample.value for metric in REGISTRY.collect() for sample in metric.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def _kvcompose_counts() -> dict[str, dict[str, float]]:
    counts = {}
    for child in CHILDREN:
        counts[child] = {
            "hits": _total("kvcompose_lookups_total", connector=child, result="hit"),
            "misses": _total("kvcompose_lookups_total", connector=child, result="miss"),
            "matched": _total("kvcompose_matched_tokens_total", connector=child),
            "loaded": _total("kvcompose_loaded_tokens_total", connector=child),
        }
    return counts


def test_preempted_requests_count_once(tiny_model: Path, tmp_path: Path) -> None:
    from kvcompose.config import load_pipeline
    from kvcompose.render import kv_transfer_config

    records = {child: tmp_path / f"{child}.jsonl" for child in CHILDREN}
    pipeline = {"version": 1, "name": "preempted", "metrics": {"enabled": True}, "children": [
        {"name": CHILDREN[0], "connector": "RecordingOffloadingConnector", "module_path": "tests.counting_children",
         "config": {"spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE, "cpu_bytes_to_use": 16 << 20,
                    "record": str(records[CHILDREN[0]])}},
        {"name": CHILDREN[1], "connector": "RecordingExampleConnector", "module_path": "tests.counting_children",
         "config": {"shared_storage_path": str(tmp_path / "disk"), "record": str(records[CHILDREN[1]])}},
    ]}
    # Four requests of three 128-token blocks each at the end, in a cache of six blocks: some are preempted.
    llm = start_llm(tiny_model, kv_transfer_config(load_pipeline(pipeline), pipeline), disable_log_stats=False,
                    num_gpu_blocks_override=6)
    try:
        before = _kvcompose_counts()
        vllm_hits_before = _total("vllm:external_prefix_cache_hits_total")
        preemptions_before = _total("vllm:num_preemptions_total")
        prompts = [prompt_words(seed=40 + index, length=150) for index in range(REQUESTS)]
        for _ in range(2):  # fresh prompts (misses), then the same again (hits, the offload child's async)
            outputs = llm.generate(prompts, greedy(max_tokens=200), use_tqdm=False)
            assert all(len(output.outputs[0].token_ids) == 200 for output in outputs)
        time.sleep(1)  # the last stats reach the front-end
        assert _total("vllm:num_preemptions_total") > preemptions_before  # the test's premise

        after = _kvcompose_counts()
        loaded = 0.0
        for child in CHILDREN:
            truth = counted(records[child])
            # vLLM asked again and allocated again for resumed requests and completed async loads.
            assert truth["asked"] > truth["lookups"] == 2 * REQUESTS
            assert truth["allocations"] > truth["lookups"]
            count = {name: after[child][name] - before[child][name] for name in after[child]}
            assert count["hits"] + count["misses"] == truth["lookups"]
            assert count["hits"] == truth["hits"]
            assert count["matched"] == truth["matched"]
            assert count["loaded"] == truth["loaded"]
            loaded += count["loaded"]
        # The second round's first admissions hit the first child, which loads them.
        assert counted(records[CHILDREN[0]])["hits"] == REQUESTS
        assert loaded > 0 and loaded == _total("vllm:external_prefix_cache_hits_total") - vllm_hits_before
    finally:
        llm.llm_engine.engine_core.shutdown()
