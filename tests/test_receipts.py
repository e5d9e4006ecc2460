"""Receipts and router predictions, driven through the real composite on the scheduler side.

Each request is looked up with a local (GPU prefix cache) hit, admitted with the
tokens its loader claimed, scheduled, and finished, as vLLM's scheduler does;
vLLM's ``invalid_block_ids`` reach the composite in a ``KVConnectorOutput``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from kvcompose.testing import recording

from .connector_support import RECORDING, composite_pair, make_blocks, scheduler_output

PROMPT_BLOCKS = 5  # a prompt of 5 blocks and 10 tokens


def _pipeline(scripts: dict[str, dict[str, Any]], **settings: Any) -> dict[str, Any]:
    children = []
    for name, script in scripts.items():
        recording.CALL_LOGS.pop(f"receipts/{name}", None)
        children.append({"name": name, **RECORDING, "config": {"log": f"receipts/{name}", "script": script}})
    return {"version": 1, "name": "receipts", "children": children, **settings}


def _request(req_id: str, block: int, params: dict[str, Any] | None = None) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params is not None else None)
    return Request(req_id, list(range(PROMPT_BLOCKS * block + 10)), sampling, None)


def _serve(scheduler: Any, request: Any, local_blocks: int = 0, invalid: set[int] | None = None,
           first_block: int = 100) -> dict[str, Any] | None:
    """Look ``request`` up after a local hit of ``local_blocks`` blocks, admit it with the tokens the loader claims,
    schedule it (its load's failed blocks: ``invalid``), finish it; its kv_transfer_params."""
    from vllm.v1.outputs import KVConnectorOutput

    block = scheduler._vllm_config.cache_config.block_size
    local = local_blocks * block
    tokens, _ = scheduler.get_num_new_matched_tokens(request, local)
    blocks = make_blocks(*range(first_block, first_block + PROMPT_BLOCKS + 1))
    scheduler.update_state_after_alloc(request, blocks, tokens)
    scheduler.build_connector_meta(scheduler_output(new=[request]))
    scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids=invalid or set()))
    request.num_computed_tokens = request.num_prompt_tokens  # prefilled
    return scheduler.request_finished(request, [])[1]


@pytest.fixture
def block(base_vllm_config: Any) -> int:
    return base_vllm_config.cache_config.block_size


def test_a_receipt_adds_up_for_a_cold_a_local_and_a_loaded_prompt(vllm_config_with: Callable, block: int) -> None:
    scripts = {"hot": {"matches": {"loaded": [[2 * block, False]]}}, "cold": {}}
    scheduler, _ = composite_pair(vllm_config_with, _pipeline(scripts, receipts=True))
    prompt = PROMPT_BLOCKS * block + 10
    cold = _serve(scheduler, _request("cold", block))
    assert cold == {"kvcompose": {"prompt_tokens": prompt, "gpu_cached_tokens": 0, "tiers": {"hot": 0, "cold": 0},
                                  "computed_tokens": prompt, "recomputed_tokens": 0, "loaded_from": None}}
    local = _serve(scheduler, _request("local", block), local_blocks=3)["kvcompose"]
    assert (local["gpu_cached_tokens"], local["computed_tokens"], local["loaded_from"]) == (
        3 * block, prompt - 3 * block, None)
    loaded = _serve(scheduler, _request("loaded", block), local_blocks=1)["kvcompose"]
    assert loaded["tiers"] == {"hot": 2 * block, "cold": 0} and loaded["loaded_from"] == "hot"
    assert loaded["gpu_cached_tokens"] == block and loaded["computed_tokens"] == prompt - 3 * block
    for receipt in (cold["kvcompose"], local, loaded):
        assert receipt["gpu_cached_tokens"] + sum(receipt["tiers"].values()) + receipt["computed_tokens"] == prompt
    assert scheduler.request_state_sizes() == {}


@pytest.mark.parametrize(("failed_load_block", "kept_blocks"), [(0, 0), (1, 1), (2, 2)])
def test_tokens_of_a_failed_load_count_as_computed_from_the_first_invalid_block(
    vllm_config_with: Callable, block: int, failed_load_block: int, kept_blocks: int,
) -> None:
    """vLLM truncates the request's computed tokens at its first invalid block and recomputes from there."""
    scheduler, _ = composite_pair(vllm_config_with, _pipeline({"hot": {"matches": {"r": [[3 * block, False]]}}},
                                                              receipts=True))
    # Blocks 100.. are the request's; 100 is the local hit's, the load fills 101, 102, 103.
    invalid = {101 + failed_load_block, 104 + 50}  # another request's block too, which is not this one's
    receipt = _serve(scheduler, _request("r", block), local_blocks=1, invalid=invalid)["kvcompose"]
    assert receipt["tiers"] == {"hot": kept_blocks * block}
    assert receipt["recomputed_tokens"] == (3 - kept_blocks) * block
    assert receipt["loaded_from"] == ("hot" if kept_blocks else None)
    assert receipt["computed_tokens"] == PROMPT_BLOCKS * block + 10 - block - kept_blocks * block


def test_a_load_the_loader_failed_to_accept_counts_as_computed(vllm_config_with: Callable, block: int) -> None:
    scripts = {"hot": {"matches": {"r": [[2 * block, False]]}, "raises": ["update_state_after_alloc"]}}
    scheduler, _ = composite_pair(vllm_config_with, _pipeline(scripts, receipts=True))
    receipt = _serve(scheduler, _request("r", block))["kvcompose"]
    assert receipt["tiers"] == {"hot": 0} and receipt["recomputed_tokens"] == 2 * block
    assert receipt["computed_tokens"] == PROMPT_BLOCKS * block + 10


def test_a_request_resumed_after_preemption_keeps_its_first_figures(vllm_config_with: Callable, block: int) -> None:
    """As vLLM's cached_tokens does; a block its load filled, later failing in another request, is not its."""
    from vllm.v1.outputs import KVConnectorOutput

    scheduler, _ = composite_pair(vllm_config_with, _pipeline(
        {"hot": {"matches": {"r": [[2 * block, False], [4 * block, False]]}}}, receipts=True))
    request = _request("r", block)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(*range(100, 106)), 2 * block)
    scheduler.build_connector_meta(scheduler_output(new=[request]))
    preempted = scheduler_output()
    preempted.preempted_req_ids = {"r"}
    scheduler.build_connector_meta(preempted)
    scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids={100}))  # now another request's block
    request.num_preemptions += 1
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(*range(200, 206)), 4 * block)
    request.num_computed_tokens = request.num_prompt_tokens
    receipt = scheduler.request_finished(request, [])[1]["kvcompose"]
    assert receipt["tiers"] == {"hot": 2 * block} and receipt["recomputed_tokens"] == 0


def test_an_async_load_that_failed_outright_takes_the_new_lookups_figures(
    vllm_config_with: Callable, block: int,
) -> None:
    """vLLM sets a failed async load's computed tokens back to 0 and looks the request up again."""
    scheduler, _ = composite_pair(vllm_config_with, _pipeline(
        {"hot": {"matches": {"r": [[3 * block, True], [0, False]]}}}, receipts=True))
    request = _request("r", block)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(*range(100, 106)), 3 * block)
    scheduler.build_connector_meta(scheduler_output())
    request.num_computed_tokens = 0  # the receive failed (failed_recving): vLLM frees the blocks, looks up again
    receipt = _serve(scheduler, request, local_blocks=1)["kvcompose"]
    assert receipt["tiers"] == {"hot": 0} and receipt["gpu_cached_tokens"] == block
    assert receipt["computed_tokens"] == PROMPT_BLOCKS * block + 10 - block


def test_the_receipt_merges_with_childrens_params_and_keeps_pairing_working(
    vllm_config_with: Callable, block: int,
) -> None:
    from kvcompose.connectors.pairing import PAIRING_KEY

    remote = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [1, 2]}
    scripts = {"nixl": {"params": {"p": remote}}, "other": {"params": {"p": {"their_key": 1}, "q": {"x": [1]}}}}
    prefill, _ = composite_pair(vllm_config_with, _pipeline(scripts, receipts=True))
    params = _serve(prefill, _request("p", block))
    assert params["their_key"] == 1 and params["remote_block_ids"] == [1, 2]  # children's keys kept
    entry = params[PAIRING_KEY]
    assert entry["children"] and entry["prompt_tokens"] == PROMPT_BLOCKS * block + 10  # description and receipt
    assert "prompt_tokens" not in prefill._pairing.local.to_params()  # the shared description was not changed
    assert prefill._pairing.problems(params) == []  # the decode server still reads the description
    assert _serve(prefill, _request("q", block))["x"] == [1]

    # The decode server gets the params back from a proxy, receipt included: not trusted, not counted.
    decode, _ = composite_pair(vllm_config_with, _pipeline(scripts, receipts=True))
    forwarded = {**params, PAIRING_KEY: {**entry, "gpu_cached_tokens": 10**9, "tiers": {"nixl": 10**9}}}
    receipt = _serve(decode, _request("p", block, forwarded))[PAIRING_KEY]
    assert receipt["gpu_cached_tokens"] == 0 and receipt["tiers"] == {"nixl": 0, "other": 0}
    routing = decode.get_kv_connector_stats().data.get("routing")
    assert routing is None or routing.is_empty()


def test_a_childs_own_kvcompose_key_is_never_replaced(vllm_config_with: Callable, block: int) -> None:
    scheduler, _ = composite_pair(vllm_config_with, _pipeline(
        {"odd": {"params": {"r": {"kvcompose": "the child's"}}}}, receipts=True))
    assert _serve(scheduler, _request("r", block)) == {"kvcompose": "the child's"}


@pytest.mark.parametrize("settings", [{}, {"receipts": False, "metrics": {"enabled": False}}],
                         ids=["by default", "metrics off"])
def test_without_receipts_params_are_the_childrens(vllm_config_with: Callable, block: int,
                                                    settings: dict[str, Any]) -> None:
    scheduler, _ = composite_pair(vllm_config_with, _pipeline(
        {"hot": {"params": {"a": {"k": 1}}, "matches": {"a": [[block, False]]}}}, **settings))
    assert _serve(scheduler, _request("a", block)) == {"k": 1}
    assert _serve(scheduler, _request("b", block, {"kvcompose": {"predicted_cached_tokens": 5}})) is None
    if settings:
        assert scheduler._instrumentation is None  # nothing but forwarding
    assert scheduler.request_state_sizes() == {}


def test_receipts_with_metrics_and_tracing_off_time_no_call(vllm_config_with: Callable, block: int) -> None:
    from kvcompose.instrumentation.receipts import ReceiptInstrumentation

    scheduler, worker = composite_pair(vllm_config_with, _pipeline(
        {"hot": {"matches": {"r": [[block, False]]}}}, receipts=True, metrics={"enabled": False}))
    assert isinstance(scheduler._instrumentation, ReceiptInstrumentation) and worker._instrumentation is None
    lookup = scheduler._calls.get_num_new_matched_tokens[0]
    assert lookup == scheduler.children[0].connector.get_num_new_matched_tokens  # the child's own method
    receipt = _serve(scheduler, _request("r", block, {"kvcompose": {"predicted_cached_tokens": 1}}))["kvcompose"]
    assert receipt["tiers"] == {"hot": block}
    assert scheduler.get_kv_connector_stats() is None  # no metrics: no prediction counts either


# A scripted router: (local blocks, loaded blocks, predicted tokens in blocks or None) per request.
ROUTER_SCRIPT = [
    (0, 0, 0), (0, 0, 2), (1, 0, 1), (1, 2, 3), (2, 0, 4), (0, 3, 3), (0, 3, 1), (3, 1, 4), (1, 1, 0), (0, 0, None),
    (2, 2, 4), (0, 4, 5), (1, 0, 3), (0, 2, 2), (4, 0, 2), (0, 1, None), (2, 1, 3), (1, 3, 5), (0, 0, 1), (3, 0, 3),
]


def _router_counters(config: Any, payload: dict[str, Any]) -> dict[str, float]:
    """The front-end's kvcompose_router_* counters after observing ``payload``."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.exposition import generate_latest

    from kvcompose.connectors import KVComposeConnector
    from kvcompose.exposition import read
    from kvcompose.metrics.routing import ROUTING_COUNTERS

    registry = CollectorRegistry()
    metric_types: dict[type, Any] = {kind: functools.partial(kind, registry=registry)
                                     for kind in (Counter, Gauge, Histogram)}
    prom = KVComposeConnector.build_prom_metrics(config, metric_types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(payload, 0)
    exposition = read(generate_latest(registry).decode())
    return {name: exposition.total(name) for name, _, _ in ROUTING_COUNTERS}


def test_the_router_counters_equal_the_scripts_sums(vllm_config_with: Callable, block: int) -> None:
    matches = {f"r{index}": [[loaded * block, False]] for index, (_, loaded, _) in enumerate(ROUTER_SCRIPT)}
    scheduler, _ = composite_pair(vllm_config_with, _pipeline({"hot": {"matches": matches}}, receipts=True))
    expected = dict.fromkeys(["predictions", "predicted", "reused", "over", "under"], 0)
    for index, (local, loaded, predicted) in enumerate(ROUTER_SCRIPT):
        params = None if predicted is None else {"kvcompose": {"predicted_cached_tokens": predicted * block}}
        receipt = _serve(scheduler, _request(f"r{index}", block, params), local_blocks=local)["kvcompose"]
        reused = receipt["gpu_cached_tokens"] + receipt["tiers"]["hot"]
        assert reused == (local + loaded) * block
        if predicted is not None:
            expected["predictions"] += 1
            expected["predicted"] += predicted * block
            expected["reused"] += reused
            expected["over"] += max(predicted * block - reused, 0)
            expected["under"] += max(reused - predicted * block, 0)
    assert expected["over"] and expected["under"]  # the script has both, and right ones
    stats = scheduler.get_kv_connector_stats()
    payload = type(stats).from_payload(stats.to_dict()).to_dict()  # as it crosses to the front-end
    assert _router_counters(scheduler._vllm_config, payload) == {
        "kvcompose_router_predictions_total": expected["predictions"],
        "kvcompose_router_predicted_tokens_total": expected["predicted"],
        "kvcompose_router_reused_tokens_total": expected["reused"],
        "kvcompose_router_overpredicted_tokens_total": expected["over"],
        "kvcompose_router_underpredicted_tokens_total": expected["under"],
        "kvcompose_router_predictions_invalid_total": 0,
    }
    assert scheduler.get_kv_connector_stats() is None  # reported once


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"n": [value]}
    return value


HOSTILE = {
    "negative": -1, "fraction": 12.5, "integral float": 128.0, "numeric string": "128", "boolean": True,
    "past the prompt": 10**6, "nested junk": {"a": [1, {"b": None}]}, "a list": [1, 2],
    "a KB-long string": "9" * 4096, "500-deep nesting": _nested(500),
}


def test_hostile_predictions_are_counted_invalid_and_change_nothing(vllm_config_with: Callable, block: int) -> None:
    matches = {name: [[2 * block, False]] for name in [*HOSTILE, "plain", "entry not an object"]}
    scheduler, _ = composite_pair(vllm_config_with, _pipeline({"hot": {"matches": matches}}, receipts=True))
    plain = _serve(scheduler, _request("plain", block), local_blocks=1)
    answers = {}
    for name, value in HOSTILE.items():
        answers[name] = _serve(scheduler, _request(name, block, {"kvcompose": {"predicted_cached_tokens": value}}),
                               local_blocks=1)
    answers["entry not an object"] = _serve(
        scheduler, _request("entry not an object", block, {"kvcompose": [_nested(500)]}), local_blocks=1)
    assert answers == dict.fromkeys(answers, plain)
    stats = scheduler.get_kv_connector_stats()
    assert stats.data["routing"].to_dict() == {"predictions": 0, "predicted_tokens": 0, "reused_tokens": 0,
                                               "overpredicted_tokens": 0, "underpredicted_tokens": 0,
                                               "invalid": len(HOSTILE) + 1}
    assert stats.calls.counter("hot", "loaded_tokens") == (len(HOSTILE) + 2) * 2 * block  # loads unchanged


def test_a_prediction_of_the_whole_prompt_is_valid(vllm_config_with: Callable, block: int) -> None:
    scheduler, _ = composite_pair(vllm_config_with, _pipeline({"hot": {}}))
    prompt = PROMPT_BLOCKS * block + 10
    assert _serve(scheduler, _request("r", block, {"kvcompose": {"predicted_cached_tokens": prompt}})) is None
    report = scheduler.get_kv_connector_stats().data["routing"]
    assert (report.predictions, report.overpredicted_tokens, report.invalid) == (1, prompt, 0)
