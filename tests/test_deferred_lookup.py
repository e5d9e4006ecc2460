"""A child that defers a request's lookup for good: the request is served after watchdog_s, never left waiting.

vLLM's OffloadingConnector answers a lookup "ask again later" while the blocks
it finds are still being stored, and learns that a store ended only from its
worker side. Here that side fails every time it is polled for results (a
fault-injecting wrapper around the real connector) and is isolated, so the
store of the first prompt never ends as far as its scheduler side knows:
MultiConnector would leave every repeat of the prompt waiting for ever. One
in-process engine, so the test reads the composite's own state.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcompose.testing.tiny_model import prompt_words

from .engine_support import generate, greedy, in_process_llm

pytestmark = pytest.mark.engine

PROMPT = prompt_words(seed=61, length=300)
SHORT = prompt_words(seed=62, length=20)


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    faults = tmp_path_factory.mktemp("deferred") / "faults.yaml"
    faults.write_text("")
    pipeline = {"version": 1, "name": "deferring", "watchdog_s": 1.0, "children": [
        {"name": "offload", "connector": "FaultInjectionConnector", "module_path": "kvcompose.connectors",
         "config": {"seed": 1, "faults_file": str(faults), "inner": {"connector": "OffloadingConnector", "config": {
             "spec_name": "CPUEngineOffloadingSpec", "spec_module_path": "kvcompose.offload.spec",
             "cpu_bytes_to_use": 64 << 20}}}}]}
    with in_process_llm(tiny_model, pipeline) as (llm, _):
        yield llm, faults


def _served(llm: Any, prompt: str) -> list[int]:
    """The prompt's tokens; fails (rather than hang the run) if the request is still waiting after a minute."""
    result: list[list[int]] = []
    thread = threading.Thread(target=lambda: result.append(generate(llm, [prompt])[0][0]), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert result, "the request is still waiting for its lookup after 60 s"
    return result[0]


def _deferral_failures() -> float:
    from prometheus_client import REGISTRY

    return sum(sample.value for metric in REGISTRY.collect() for sample in metric.samples
               if sample.name == "kvcompose_call_errors_total"
               and sample.labels.get("error_type") == "LookupDeferredTooLong")


def test_a_lookup_deferred_past_watchdog_s_counts_as_a_failed_lookup(engine: tuple[Any, Path],
                                                                           plain_llm: Any) -> None:
    llm, faults = engine
    expected = generate(plain_llm, [PROMPT])[0][0]
    # Not run to idle (engine_support.generate would): the store of PROMPT is issued at the engine's next step.
    first = llm.generate([PROMPT], greedy(8), use_tqdm=False)[0]
    assert list(first.outputs[0].token_ids) == expected
    # From now on the offload tier's worker side fails when polled for results: the store of PROMPT, issued
    # in the next step, never ends for its scheduler side.
    faults.write_text(yaml.safe_dump({"raise": {"get_transfer_results": 1.0}}))
    generate(llm, [SHORT])
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    # The repeat is deferred, then served (prefilled, from no tier) once the deferral passed watchdog_s.
    assert _served(llm, PROMPT) == expected
    assert _deferral_failures() == 1
    assert _served(llm, PROMPT) == expected  # and again: each repeat is served
    assert _deferral_failures() >= 1
    assert scheduler.request_state_sizes() == {}
