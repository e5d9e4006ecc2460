"""Per-child stats from two real workers (tensor_parallel_size=2 on the CPU engine).

Each worker records its own child calls; vLLM's ``KVOutputAggregator`` merges
the two workers' ``KVComposeStats`` every step, the scheduler's are merged in,
and the front-end's Prometheus registry shows the result.

What is compared with a single-worker run, and how:

- Scheduler-side counts (lookups and their hit/miss, matched and loaded
  tokens, ``update_state_after_alloc``, ``request_finished``) must be what
  one worker gives: they are derived from the workload (one lookup per request
  per child; which store holds the prompt) and from vLLM's own
  ``num_cached_tokens``, not from a second engine.
- Worker-side calls (``start_load_kv``, ``wait_for_save``,
  ``get_transfer_results``, ``get_block_ids_with_load_errors``) happen once
  per step in every worker, and ``build_connector_meta`` once per step in the
  scheduler. One worker gives equal counts (measured with this workload:
  29 and 29 in one run, 28 and 56 with two workers in another); two workers
  must give exactly twice ``build_connector_meta``. The step count itself
  varies by a step from run to run, so it is not compared with a stored figure.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from kvcompose.config import load_pipeline
from kvcompose.render import kv_transfer_config
from kvcompose.testing.tiny_model import prompt_words

from .engine_support import example_tiers, generate, start_llm

pytestmark = pytest.mark.engine

WORKERS = 2
MAX_TOKENS = 8
PROMPTS = [prompt_words(seed=40 + i, length=96) for i in range(2)]
SCHEDULER_OPS = ("lookup", "update_state_after_alloc", "request_finished")
WORKER_OPS = ("start_load_kv", "wait_for_save", "get_transfer_results", "get_block_ids_with_load_errors")


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-stores")
    return {"hot": root / "hot", "cold": root / "cold"}


@pytest.fixture(scope="module")
def tp_llm(tiny_model: Path, stores: dict[str, Path]) -> Any:
    # Every call timed: this test checks how the workers' stats merge, and offline LLM.generate leaves the
    # calls of its last steps that a sample has not credited yet for its next call (see test_serve).
    pipeline = example_tiers("tp", stores)
    # One core per worker (the CPU backend otherwise wants a NUMA node each);
    # set only while the engine's processes start, so later engines bind as usual.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        llm = start_llm(tiny_model, kv_transfer_config(load_pipeline(pipeline), pipeline),
                        tensor_parallel_size=WORKERS, disable_log_stats=False)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_two_workers_merge_worker_calls_and_keep_scheduler_counts(tp_llm: Any, stores: dict[str, Path]) -> None:
    from prometheus_client import generate_latest

    from kvcompose.metrics.summary import summarize

    first = generate(tp_llm, PROMPTS, MAX_TOKENS)
    assert all(cached == 0 for _, cached in first)
    from_hot = generate(tp_llm, PROMPTS, MAX_TOKENS)
    shutil.rmtree(stores["hot"])
    from_cold = generate(tp_llm, PROMPTS, MAX_TOKENS)
    # Both workers' halves of the KV cache were saved and loaded: same tokens.
    for rerun in (from_hot, from_cold):
        assert [tokens for tokens, _ in rerun] == [tokens for tokens, _ in first]
        assert all(cached > 0 for _, cached in rerun)

    children = summarize(generate_latest().decode())
    requests = 3 * len(PROMPTS)
    hot, cold = children["hot"], children["cold"]
    # Every child is asked once per request; cold holds what hot held, and
    # still holds it after hot is wiped.
    assert dict(hot.lookups) == {"hit": len(PROMPTS), "miss": requests - len(PROMPTS)}
    assert dict(cold.lookups) == {"hit": 2 * len(PROMPTS), "miss": len(PROMPTS)}
    assert hot.loaded_tokens == sum(cached for _, cached in from_hot)
    assert cold.loaded_tokens == sum(cached for _, cached in from_cold)
    assert cold.matched_tokens == hot.loaded_tokens + cold.loaded_tokens

    for child in (hot, cold):
        assert {op: child.calls(op) for op in SCHEDULER_OPS} == dict.fromkeys(SCHEDULER_OPS, requests)
        steps = child.calls("build_connector_meta")
        assert steps >= 3 * MAX_TOKENS  # a round takes a step per generated token
        assert {op: child.calls(op) for op in WORKER_OPS} == dict.fromkeys(WORKER_OPS, WORKERS * steps)
