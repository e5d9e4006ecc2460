"""A soak: 1000 requests, a quarter of them aborted, through a failing pipeline on a real engine.

Afterwards no per-request state is left anywhere: not in the scheduler's or the
worker's composite (``request_state_sizes()``), nor in the fault injector
inside each. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so the test can read them. Requests arrive in waves; in each, some are aborted
while still waiting, some after their first step. The first child fails a
tenth of the calls of every operation that keeps per-request state and lies
about a fifth of its hits; half the requests are traced.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from kvcompose.config import load_pipeline
from kvcompose.render import kv_transfer_config
from kvcompose.testing.tiny_model import prompt_words

from .engine_support import greedy, in_process_connectors, start_llm

pytestmark = pytest.mark.engine

REQUESTS, WAVE, MAX_TOKENS = 1000, 50, 3
PROMPTS = [prompt_words(seed=9000 + i, length=96) for i in range(100)]  # 138 tokens, each sent 10 times
FAULTS = {
    "raise": {op: 0.1 for op in (
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
        "bind_connector_metadata", "start_load_kv", "save_kv_layer", "get_transfer_results",
        "get_block_ids_with_load_errors", "clear_connector_metadata",
    )},
    "lie": 0.2,
}


def _pipeline(root: Path) -> dict[str, Any]:
    flaky = {
        "name": "flaky", "connector": "FaultInjectionConnector", "module_path": "kvcompose.connectors",
        "circuit_breaker": {"failures": 3, "cooldown_s": 0.2},
        "config": {"seed": 9, "faults": FAULTS, "inner": {
            "connector": "ExampleConnector", "config": {"shared_storage_path": str(root / "flaky")}}},
    }
    cold = {"name": "cold", "connector": "ExampleConnector", "config": {"shared_storage_path": str(root / "cold")}}
    return {"version": 1, "name": "soak", "children": [flaky, cold],
            "tracing": {"enabled": True, "exporter": "none", "sample_ratio": 0.5}}


def _soak(engine: Any) -> tuple[dict[str, Any], set[str]]:
    """Every request's final output, and the ids of those aborted (waiting, or after one step)."""
    finished: dict[str, Any] = {}
    aborted: set[str] = set()

    def step() -> None:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output

    for start in range(0, REQUESTS, WAVE):
        wave = range(start, start + WAVE)
        for index in wave:
            engine.add_request(f"soak-{index}", PROMPTS[index % len(PROMPTS)], greedy(MAX_TOKENS))
        waiting = [f"soak-{index}" for index in wave if index % 8 == 3]
        engine.abort_request(waiting)
        step()
        running = [f"soak-{index}" for index in wave if index % 8 == 6]
        engine.abort_request(running)
        aborted.update(waiting, running)
        while engine.has_unfinished_requests():
            step()
    return finished, aborted


def test_a_thousand_requests_with_aborts_leave_no_per_request_state(tiny_model: Path, tmp_path: Path) -> None:
    import vllm.envs

    pipeline = _pipeline(tmp_path)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm.envs.disable_envs_cache()
        # A wave's prompts fit in one step: ExampleConnector saves a request's blocks in its first step, so a
        # prefill split over steps would be saved half computed (and its repeats load that), connector or not.
        llm = start_llm(tiny_model, kv_transfer_config(load_pipeline(pipeline), pipeline),
                        max_num_batched_tokens=WAVE * 160)
        try:
            finished, aborted = _soak(llm.llm_engine)
            composites = in_process_connectors(llm)
            injectors = [composite.children[0].connector for composite in composites]
            left = {
                "scheduler": composites[0].request_state_sizes(), "worker": composites[1].request_state_sizes(),
                "injector in the scheduler": injectors[0].request_state_sizes(),
                "injector in the worker": injectors[1].request_state_sizes(),
            }
            injected = sum(sum(injector.plan.injected.values()) for injector in injectors)
            scheduler_requests = len(llm.llm_engine.engine_core.engine_core.scheduler.requests)
        finally:
            llm.llm_engine.engine_core.shutdown()
    vllm.envs.disable_envs_cache()

    assert len(aborted) == REQUESTS // 4
    completed = {request_id: output for request_id, output in finished.items() if request_id not in aborted}
    assert len(completed) == REQUESTS - len(aborted)
    assert {output.outputs[0].finish_reason for output in completed.values()} == {"length"}
    tokens_by_prompt: defaultdict[str, set[tuple[int, ...]]] = defaultdict(set)
    for output in completed.values():
        tokens_by_prompt[output.prompt].add(tuple(output.outputs[0].token_ids))
    assert all(len(tokens) == 1 for tokens in tokens_by_prompt.values())  # computed or loaded, the same tokens
    assert sum(1 for output in completed.values() if output.num_cached_tokens) > REQUESTS // 4  # repeats loaded
    assert injected > 100  # the faults did fire
    assert scheduler_requests == 0
    assert left == {"scheduler": {}, "worker": {}, "injector in the scheduler": {}, "injector in the worker": {}}
