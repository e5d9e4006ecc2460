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
