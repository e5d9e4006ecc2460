"""Receipts and router predictions under the OpenAI server, against vLLM's own counts.

Two disk tiers (ExampleConnector): the first, ``flaky``, wrapped in kvcompose's
FaultInjectionConnector, whose faults file is empty until the failure case. The
server runs with ``--enable-prompt-tokens-details``, so each response carries
vLLM's ``cached_tokens`` beside the receipt, and with kvcompose serve's
prediction-header middleware. Prefix caching is off (as for every test
server): the GPU cache serves no prompt, the tiers do.

- a cold prompt: all computed;
- the same prompt again: loaded from ``flaky``, the first tier, as vLLM counts it
  cached, and as ``kvcompose_loaded_tokens_total`` grew;
- a stored prompt whose load fails (every hit a lie): recomputed. vLLM still
  counts the failed tokens in ``cached_tokens`` (it fixes its first
  scheduling's count), kvcompose counts them computed;
- hostile predictions: the same text as without, counted invalid.

vLLM itself cannot take kv_transfer_params nested some 500 levels deep: its
engine core dies pickling the scheduler's output for the workers (see the
hostile test), so that depth is tested on the composite alone
(tests/test_receipts.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcompose.exposition import read
from kvcompose.testing.tiny_model import prompt_words

from .server_support import Server, start_server

pytestmark = pytest.mark.engine

BLOCK = 128  # the CPU engine's block size


@pytest.fixture(scope="module")
def receipts_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    root = tmp_path_factory.mktemp("receipts-serve")
    faults = root / "faults.yaml"
    faults.write_text("")
    pipeline = {"version": 1, "name": "receipts", "receipts": True, "children": [
        {"name": "flaky", "connector": "FaultInjectionConnector", "module_path": "kvcompose.connectors",
         "circuit_breaker": {"enabled": False},
         "config": {"seed": 1, "faults_file": str(faults), "inner": {
             "connector": "ExampleConnector", "config": {"shared_storage_path": str(root / "flaky")}}}},
        {"name": "disk", "connector": "ExampleConnector", "config": {"shared_storage_path": str(root / "disk")}},
    ]}
    config = {"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"pipeline": pipeline}}
    server = start_server(tiny_model, json.dumps(config), root / "server.log", extra_args=[
        "--enable-prompt-tokens-details", "--middleware", "kvcompose.prediction_header.PredictionHeaderMiddleware"])
    yield server, faults
    server.stop()


def _counter(server: Server, name: str, **labels: str) -> float:
    return read(server.metrics()).total(name, **labels)


def _grown_to(server: Server, name: str, value: float, **labels: str) -> float:
    """The counter once it reached ``value`` (stats reach the front-end a step or so after the request), or as it
    is after 120 looks."""
    for _ in range(120):
        if (now := _counter(server, name, **labels)) >= value:
            return now
        time.sleep(0.5)
    return now


def _check(response: dict[str, Any]) -> dict[str, Any]:
    """The response's receipt, checked to add up."""
    receipt = response["kv_transfer_params"]["kvcompose"]
    prompt = response["usage"]["prompt_tokens"]
    assert receipt["prompt_tokens"] == prompt
    assert receipt["gpu_cached_tokens"] + sum(receipt["tiers"].values()) + receipt["computed_tokens"] == prompt
    assert set(receipt["tiers"]) == {"flaky", "disk"}
    return receipt


def test_receipts_match_vllms_cached_tokens_and_the_loaded_counter(receipts_server: tuple[Server, Path]) -> None:
    server, faults = receipts_server
    prompt = prompt_words(seed=41, length=300)
    loaded_before = _counter(server, "kvcompose_loaded_tokens_total", connector="flaky")

    cold = server.complete(prompt)
    receipt = _check(cold)
    assert receipt["tiers"] == {"flaky": 0, "disk": 0} and receipt["loaded_from"] is None
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 == receipt["gpu_cached_tokens"]

    # Whole blocks of the prompt, but its last token; the router predicts the whole prompt.
    prompt_tokens = cold["usage"]["prompt_tokens"]
    expected = (prompt_tokens - 1) // BLOCK * BLOCK
    warm = server.complete(prompt, kv_transfer_params={"kvcompose": {"predicted_cached_tokens": prompt_tokens}})
    receipt = _check(warm)
    loaded = receipt["tiers"]["flaky"]
    assert receipt["loaded_from"] == "flaky" and loaded == expected > 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == receipt["gpu_cached_tokens"] + loaded
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert _grown_to(server, "kvcompose_loaded_tokens_total", loaded_before + loaded,
                     connector="flaky") == loaded_before + loaded

    # A stored prompt whose load fails: every hit of flaky is a lie from now on.
    failing = prompt_words(seed=42, length=300)
    first = server.complete(failing)
    errors_before = _counter(server, "kvcompose_load_error_blocks_total", connector="flaky")
    faults.with_name("faults.tmp").write_text(yaml.safe_dump({"lie": 1.0}))
    faults.with_name("faults.tmp").rename(faults)
    failed = server.complete(failing, headers={"x-kvcompose-predicted-cached-tokens": str(loaded)})
    faults.with_name("faults.tmp").write_text("")
    faults.with_name("faults.tmp").rename(faults)
    receipt = _check(failed)
    assert receipt["tiers"] == {"flaky": 0, "disk": 0} and receipt["loaded_from"] is None
    assert receipt["recomputed_tokens"] == loaded and receipt["computed_tokens"] == receipt["prompt_tokens"]
    assert failed["choices"][0]["text"] == first["choices"][0]["text"]  # recomputed, same answer
    # vLLM's count of that request fixed its first scheduling's figures: the failed tokens as cached.
    assert failed["usage"]["prompt_tokens_details"]["cached_tokens"] == (
        receipt["gpu_cached_tokens"] + sum(receipt["tiers"].values()) + receipt["recomputed_tokens"])
    assert _grown_to(server, "kvcompose_load_error_blocks_total", errors_before + loaded // BLOCK,
                     connector="flaky") == errors_before + loaded // BLOCK

    # Two predictions: the whole prompt, of which ``loaded`` were; then ``loaded``, of which none were.
    assert _grown_to(server, "kvcompose_router_predictions_total", 2) == 2
    assert _counter(server, "kvcompose_router_predicted_tokens_total") == prompt_tokens + loaded
    assert _counter(server, "kvcompose_router_reused_tokens_total") == loaded
    assert _counter(server, "kvcompose_router_overpredicted_tokens_total") == prompt_tokens
    assert _counter(server, "kvcompose_router_predictions_invalid_total") == 0
    assert _counter(server, "kvcompose_router_underpredicted_tokens_total") == 0


def _nested(depth: int) -> Any:
    """A value nested ``depth`` JSON levels deep (objects and arrays in turn)."""
    value: Any = 1
    for _ in range(depth // 2):
        value = {"n": [value]}
    return value


def test_hostile_predictions_change_no_answer_and_count_invalid(receipts_server: tuple[Server, Path]) -> None:
    server, _ = receipts_server
    prompt = prompt_words(seed=43, length=200)
    plain = server.complete(prompt)
    invalid_before = _counter(server, "kvcompose_router_predictions_invalid_total")
    hostile = [{"kvcompose": {"predicted_cached_tokens": value}}
               # Not 500 levels here: vLLM's engine core dies pickling such kv_transfer_params for its workers
               # (RecursionError in shm_broadcast, whatever the connector); tests/test_receipts.py reads 500.
               for value in ("9" * 2048, -1, 12.5, 10**6, {"a": [1, {"b": None}]}, _nested(100))]
    answers = [server.complete(prompt, kv_transfer_params=params) for params in hostile]
    answers.append(server.complete(prompt, headers={"x-kvcompose-predicted-cached-tokens": "x" * 1024}))
    for answer in answers:
        assert answer["choices"][0]["text"] == plain["choices"][0]["text"]
        assert _check(answer)["tiers"] == _check(plain)["tiers"] or _check(answer)["loaded_from"] == "flaky"
    assert _grown_to(server, "kvcompose_router_predictions_invalid_total",
                     invalid_before + len(answers)) == invalid_before + len(answers)
