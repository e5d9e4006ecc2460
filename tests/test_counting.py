"""What the counters mean, counted where vLLM counts it.

Lookups count once per admitted request, however often vLLM asked while the
request waited for blocks; blocks that failed to load count once however many
tensor-parallel workers reported them, as vLLM recomputes them once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from kvcompose.testing import recording
from kvcompose.testing.steps import forward_step
from kvcompose.wire.calls import COUNTERS

from .connector_support import RECORDING, composite_pair, make_blocks, make_request, scheduler_output

# These tests read the stats a step at a time.
pytestmark = pytest.mark.usefixtures("tables_every_step")


def _pipeline(scripts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    children = []
    for name, script in scripts.items():
        recording.CALL_LOGS.pop(f"counting/{name}", None)
        children.append({"name": name, **RECORDING, "config": {"log": f"counting/{name}", "script": script}})
    return {"version": 1, "name": "counting", "children": children}


def _lookup_counters(scheduler: Any) -> dict[str, dict[str, int]]:
    """Each child's non-zero lookup and token counters in the scheduler's stats of its next step (built here, with
    no forward pass: its stats go out)."""
    scheduler.build_connector_meta(scheduler_output())
    calls = scheduler.get_kv_connector_stats().calls
    counters = {child: {name: count for name in COUNTERS if (count := calls.counter(child, name))}
                for child in calls.children}
    return {child: counts for child, counts in counters.items() if counts}


def test_a_lookup_vllm_asks_again_counts_once_when_the_request_is_admitted(vllm_config_with: Callable) -> None:
    scheduler, _ = composite_pair(vllm_config_with, _pipeline({"hot": {"matches": {"r1": [[32, False]]}}, "cold": {}}))
    request = make_request("r1")
    for _ in range(3):  # vLLM asks every step while the request waits for free blocks
        assert scheduler.get_num_new_matched_tokens(request, 0) == (32, False)
    waiting = scheduler.get_kv_connector_stats().calls
    # Every call is timed and counted.
    assert waiting.call_count("hot", "lookup") == 3
    assert sum(count for cell, (count, _) in waiting.cells.items()
               if waiting.operation_of(cell) == ("hot", "lookup")) == 3
    assert not any(waiting.counters)  # nothing counted before admission

    scheduler.update_state_after_alloc(request, make_blocks(1, 2, 3), 32)  # admitted
    assert _lookup_counters(scheduler) == {"hot": {"lookup_hits": 1, "matched_tokens": 32, "loaded_tokens": 32},
                                           "cold": {"lookup_misses": 1}}


def test_the_last_lookup_round_before_admission_is_the_one_counted(vllm_config_with: Callable) -> None:
    # hot had the tokens when first asked, then evicted them; cold stored them meanwhile.
    scheduler, _ = composite_pair(vllm_config_with, _pipeline({
        "hot": {"matches": {"r1": [[32, False], [0, False]]}}, "cold": {"matches": {"r1": [[0, False], [16, False]]}}}))
    request = make_request("r1")
    assert scheduler.get_num_new_matched_tokens(request, 0) == (32, False)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (16, False)
    scheduler.update_state_after_alloc(request, make_blocks(1, 2), 16)
    assert _lookup_counters(scheduler) == {"hot": {"lookup_misses": 1},
                                           "cold": {"lookup_hits": 1, "matched_tokens": 16, "loaded_tokens": 16}}


def test_a_request_finished_while_waiting_counts_no_lookup_and_leaves_nothing(vllm_config_with: Callable) -> None:
    scheduler, _ = composite_pair(vllm_config_with, _pipeline({"hot": {"matches": {"r1": [[32, False]]}}}))
    request = make_request("r1")
    scheduler.get_num_new_matched_tokens(request, 0)
    assert scheduler.request_state_sizes()["lookup_rounds"] == 1
    scheduler.request_finished(request, [])  # aborted before vLLM found blocks for it
    assert _lookup_counters(scheduler) == {}
    assert scheduler.request_state_sizes() == {}


def test_a_request_readmitted_after_preemption_counts_once(vllm_config_with: Callable) -> None:
    """Lookups and tokens count once per request: vLLM keeps preempted requests out of its external-cache hit
    ratio too. (The second load's bytes are a transfer of their own: see the transfer metrics.)"""
    scheduler, _ = composite_pair(vllm_config_with, _pipeline({"hot": {"matches": {"r1": [[32, False]]}}}))
    request = make_request("r1")
    for _ in range(2):
        scheduler.get_num_new_matched_tokens(request, 0)
        scheduler.update_state_after_alloc(request, make_blocks(1, 2), 32)
        request.num_preemptions += 1  # preempted: vLLM looks it up again when it is rescheduled
    assert _lookup_counters(scheduler) == {"hot": {"lookup_hits": 1, "matched_tokens": 32, "loaded_tokens": 32}}


def _load_error_blocks_in_prometheus(config: Any, payload: dict[str, Any], child: str) -> float:
    """The front-end's kvcompose_load_error_blocks_total for ``child`` after observing ``payload``."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.exposition import generate_latest

    from kvcompose.connectors import KVComposeConnector
    from kvcompose.exposition import read

    registry = CollectorRegistry()
    metric_types: dict[type, Any] = {kind: functools.partial(kind, registry=registry)
                                     for kind in (Counter, Gauge, Histogram)}
    prom = KVComposeConnector.build_prom_metrics(config, metric_types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(payload, 0)
    return read(generate_latest(registry).decode()).total("kvcompose_load_error_blocks_total", connector=child)


# How each of two tensor-parallel workers' "hot" child behaves in the step of a load of blocks 8 and 9.
WORKER_FAILURES = {
    "both workers fail the load": ({"raises": ["start_load_kv"]}, {"raises": ["start_load_kv"]}),
    "one fails, the other reports a block itself": ({"load_errors": [8]}, {"raises": ["start_load_kv"]}),
    "only one worker fails": ({}, {"raises": ["start_load_kv"]}),
}


@pytest.mark.parametrize("failures", WORKER_FAILURES.values(), ids=WORKER_FAILURES.keys())
def test_load_errors_of_tensor_parallel_workers_count_as_vllm_merges_them(
    vllm_config_with: Callable, base_vllm_config: Any, failures: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from kvcompose.connectors import KVComposeConnector

    block = base_vllm_config.cache_config.block_size
    scripts = {"hot": {"matches": {"r1": [[2 * block, False]]}}, "cold": {}}
    scheduler, first_worker = composite_pair(vllm_config_with, _pipeline(scripts))
    workers = [first_worker, KVComposeConnector(first_worker._vllm_config, KVConnectorRole.WORKER, None)]
    for worker, failure in zip(workers, failures, strict=True):
        worker.children[0].connector.script = {**scripts["hot"], **failure}

    request = make_request("r1")
    tokens, _ = scheduler.get_num_new_matched_tokens(request, block)
    scheduler.update_state_after_alloc(request, make_blocks(7, 8, 9, 10), tokens)  # one local block; loads 8, 9
    metadata = scheduler.build_connector_meta(scheduler_output(new=[request]))
    outputs = []
    for worker in workers:  # each worker runs the step with the same metadata, as with tensor_parallel_size=2
        worker.bind_connector_metadata(metadata)
        results, load_errors = forward_step(worker)
        outputs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            kv_connector_stats=worker.get_kv_connector_stats(), invalid_block_ids=load_errors)))
        worker.clear_connector_metadata()

    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs).kv_connector_output
    assert merged.invalid_block_ids == {8, 9}  # what vLLM recomputes
    stats = merged.kv_connector_stats
    assert stats.calls.load_error_blocks("hot") == 2
    payload = type(stats).from_payload(stats.to_dict()).to_dict()  # as it crosses to the front-end
    assert _load_error_blocks_in_prometheus(scheduler._vllm_config, payload, "hot") == 2


def test_a_block_that_fails_again_in_a_later_step_counts_again(vllm_config_with: Callable) -> None:
    from kvcompose.wire.stats import KVComposeStats

    scheduler, worker = composite_pair(vllm_config_with, _pipeline({"hot": {"load_errors": [5]}}))
    steps = []
    for _ in range(2):  # block ids are reused: however the steps' payloads are merged, each failure counts
        worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output()))
        forward_step(worker)
        steps.append(worker.get_kv_connector_stats())
        worker.clear_connector_metadata()
    assert KVComposeStats().aggregate(steps[0]).aggregate(steps[1]).calls.load_error_blocks("hot") == 2


@pytest.mark.parametrize(("policy", "forgone"), [("first_match", {"cold": {"forgone_tokens": 32}}),
                                                  ("longest_match", {})])
def test_tokens_a_later_loader_had_beyond_the_chosen_ones_are_forgone(
    vllm_config_with: Callable, policy: str, forgone: dict[str, dict[str, int]],
) -> None:
    pipeline = _pipeline({"hot": {"matches": {"r1": [[32, False]]}}, "cold": {"matches": {"r1": [[64, False]]}}})
    scheduler, _ = composite_pair(vllm_config_with, {**pipeline, "load": {"policy": policy}})
    request = make_request("r1")
    tokens, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(1, 2, 3, 4), tokens)
    counters = _lookup_counters(scheduler)
    assert {child: {name: count for name, count in counts.items() if name == "forgone_tokens"}
            for child, counts in counters.items() if "forgone_tokens" in counts} == forgone
    forgone_tokens = sum(counts.get("forgone_tokens", 0) for counts in counters.values())
    assert tokens + forgone_tokens == 64  # what longest_match loads
