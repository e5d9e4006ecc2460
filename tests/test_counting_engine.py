"""Counts stay once per request on a real engine whose KV cache is small enough to preempt requests.

vLLM preempts a running request when the KV cache runs out, frees its blocks,
and admits it again later: it looks the request up again and calls
``update_state_after_alloc`` again. kvcompose's lookups count once per
request all the same, as vLLM's own prefix-cache queries do.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvcompose.testing.tiny_model import prompt_words

from .engine_support import example_tiers, greedy, start_llm

pytestmark = pytest.mark.engine

REQUESTS = 4


def _total(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return sum(sample.value for metric in REGISTRY.collect() for sample in metric.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def test_preempted_requests_count_once(tiny_model: Path, tmp_path: Path) -> None:
    from kvcompose.config import load_pipeline
    from kvcompose.render import kv_transfer_config

    pipeline = example_tiers("preempted", {"hot": tmp_path / "hot", "cold": tmp_path / "cold"})
    # Four requests of three 128-token blocks each at the end, in a cache of six blocks: some are preempted.
    llm = start_llm(tiny_model, kv_transfer_config(load_pipeline(pipeline), pipeline), disable_log_stats=False,
                    num_gpu_blocks_override=6)
    try:
        prompts = [prompt_words(seed=40 + index, length=150) for index in range(REQUESTS)]
        outputs = llm.generate(prompts, greedy(max_tokens=200), use_tqdm=False)
        assert all(len(output.outputs[0].token_ids) == 200 for output in outputs)
        time.sleep(1)  # the last stats reach the front-end
        assert _total("vllm:num_preemptions_total") > 0  # the test's premise
        # Fresh prompts: every first admission is a miss. A resumed request finds its prompt saved and loads it,
        # but counts no second lookup: vLLM's own external hit count leaves preempted requests out too.
        for child in ("hot", "cold"):
            assert _total("kvcompose_lookups_total", connector=child, result="miss") == REQUESTS
            assert _total("kvcompose_lookups_total", connector=child, result="hit") == _total(
                "vllm:external_prefix_cache_hits_total")
    finally:
        llm.llm_engine.engine_core.shutdown()
