"""A broken first tier on a real engine: no lost request, no wrong token, and it shows.

One in-process engine (scheduler and worker in this process, so the test can
read the composite's own state) runs a pipeline whose first child raises on
lookups, loads and saves at set, seeded rates, in front of a healthy second
child. Its spans go to an in-memory exporter and, through a batch processor,
to a collector that is not there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvcompose.connectors.isolation import BreakerState
from kvcompose.logs import ROOT_LOGGER
from kvcompose.metrics.summary import summarize
from kvcompose.testing.tiny_model import prompt_words

from .engine_support import generate, in_process_llm

pytestmark = pytest.mark.engine

PROMPTS = [prompt_words(seed=200 + i, length=96) for i in range(8)]
FAULTS = {"raise": {"get_num_new_matched_tokens": 0.2, "start_load_kv": 0.5, "save_kv_layer": 0.3}}
BREAKER = {"failures": 3, "cooldown_s": 0.5}


class FaultyEngine:
    def __init__(self, llm: Any, stores: dict[str, Path], spans: InMemorySpanExporter, faults_file: Path) -> None:
        self.llm, self.stores, self.spans, self.faults_file = llm, stores, spans, faults_file

    def inject(self, faults: dict[str, Any]) -> None:
        """Change the flaky tier's faults, in place for the running engine (written aside, renamed over)."""
        staged = self.faults_file.with_suffix(".next")
        staged.write_text(yaml.safe_dump(faults))
        staged.replace(self.faults_file)

    @property
    def scheduler_side(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core.scheduler.connector

    @property
    def worker_side(self) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()

    def metrics(self) -> dict[str, Any]:
        from prometheus_client import generate_latest

        return summarize(generate_latest().decode())


@pytest.fixture(scope="module")
def faulty(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultyEngine]:
    root = tmp_path_factory.mktemp("faulty")
    stores = {"flaky": root / "flaky", "cold": root / "cold"}
    faults_file = root / "faults.yaml"
    faults_file.write_text(yaml.safe_dump(FAULTS))
    tracing = {"enabled": True, "granularity": "step"}
    pipeline = {"version": 1, "name": "faulty", "tracing": tracing, "children": [
        {"name": "flaky", "connector": "FaultInjectionConnector", "module_path": "kvcompose.connectors",
         "circuit_breaker": BREAKER,
         "config": {"seed": 5, "faults_file": str(faults_file), "inner": {
             "connector": "ExampleConnector", "config": {"shared_storage_path": str(stores["flaky"])}}}},
        {"name": "cold", "connector": "ExampleConnector", "config": {"shared_storage_path": str(stores["cold"])}},
    ]}
    # Spans in memory (the unreachable collector is tests/test_span_shipping.py's).
    with in_process_llm(tiny_model, pipeline) as (llm, spans):
        yield FaultyEngine(llm, stores, spans, faults_file)


@pytest.fixture(scope="module")
def expected(plain_llm: Any) -> list[list[int]]:
    return [tokens for tokens, _ in generate(plain_llm, PROMPTS)]


def test_every_request_completes_with_the_plain_tokens(faulty: FaultyEngine, expected: list[list[int]]) -> None:
    served_from_cache = 0
    for _ in range(3):  # cold stores, then repeats served by whichever tier answers
        outputs = generate(faulty.llm, PROMPTS)
        assert [tokens for tokens, _ in outputs] == expected
        served_from_cache += sum(cached for _, cached in outputs)
    assert served_from_cache > 0  # the repeats did go through the tiers

    # The healthy tier holds every prompt: the first round saved each one there.
    assert len({path.parent for path in faulty.stores["cold"].rglob("*.safetensors")}) == len(PROMPTS)

    flaky = faulty.metrics()["flaky"]
    assert flaky.errors["lookup"] > 0 and flaky.errors["start_load_kv"] > 0
    assert flaky.load_error_blocks > 0  # the failed loads' blocks, given back to vLLM for recompute
    assert "cold" not in {name for name, row in faulty.metrics().items() if row.errors}

    failed = [span for span in faulty.spans.get_finished_spans() if span.status.status_code is StatusCode.ERROR]
    assert {span.attributes["kvcompose.connector.name"] for span in failed} == {"flaky"}
    error_types = {span.attributes["error.type"] for span in failed}
    assert "kvcompose.faults.InjectedFault" in error_types
    assert error_types <= {"kvcompose.faults.InjectedFault", "kvcompose.circuit_open"}  # or skipped while open


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_circuit_breaker_opens_and_closes_again(faulty: FaultyEngine, expected: list[list[int]]) -> None:
    """The breaker opens under the faults, and once the tier recovers its probe closes the circuit.

    It may have opened during the test before: on a fast machine a whole round runs within one cool-down,
    so whether an opening happens while this test watches is a matter of speed. The metric says it did."""

    def opened() -> bool:
        return faulty.metrics()["flaky"].breaker_opens > 0

    for _ in range(6):  # the faults are seeded draws: give the breaker a few rounds to open
        if opened():
            break
        assert [tokens for tokens, _ in generate(faulty.llm, PROMPTS)] == expected
    assert opened()

    log = _Lines()
    logging.getLogger(ROOT_LOGGER).addHandler(log)

    def transitions() -> set[str]:
        return {state for line in log.lines if "circuit breaker" in line
                for state in ("open", "half_open", "closed") if f"state={state}" in line}

    try:
        faulty.inject({})  # the tier recovers
        for _ in range(6):  # after the cool-down, a probe goes through, succeeds and closes the circuit
            time.sleep(BREAKER["cooldown_s"])
            assert [tokens for tokens, _ in generate(faulty.llm, PROMPTS)] == expected
            if {"half_open", "closed"} <= transitions() and _all_closed(faulty):
                break
    finally:
        faulty.inject(FAULTS)
        logging.getLogger(ROOT_LOGGER).removeHandler(log)
    assert {"half_open", "closed"} <= transitions()
    assert _all_closed(faulty)
    events = {event.attributes["state"] for span in faulty.spans.get_finished_spans() for event in span.events
              if event.name == "kvcompose.circuit_breaker"}
    assert "open" in events


def _all_closed(faulty: FaultyEngine) -> bool:
    """Every circuit of the engine is closed, on the scheduler and on the worker."""
    return all(guard.state is BreakerState.CLOSED
               for side in (faulty.scheduler_side, faulty.worker_side) for guard in side._guards)


def test_a_soak_leaves_no_per_request_state_behind(faulty: FaultyEngine) -> None:
    from vllm import SamplingParams

    prompts = [prompt_words(seed=1000 + i, length=24) for i in range(500)]
    outputs = faulty.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                                  use_tqdm=False)
    assert len(outputs) == 500 and all(len(o.outputs[0].token_ids) == 2 for o in outputs)
    assert faulty.scheduler_side.request_state_sizes() == {}
    assert faulty.worker_side.request_state_sizes() == {}
