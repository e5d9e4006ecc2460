"""Sampled call timing: one call (scheduler) or step (worker) in ``metrics.sample_every`` is timed, every call is
counted.

Driven step by step over scripted children, as vLLM orders the calls. The
figures that show what sampling saves are the hot-path benchmark's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvcompose.testing import recording

from .connector_support import RECORDING, composite_pair, make_blocks, make_request, scheduler_output

def _pair(vllm_config_with: Callable, every: int, hot: dict[str, Any] | None = None, tracing: bool = False,
          granularity: str = "request", **hot_config: Any) -> tuple[Any, Any]:
    children = []
    for name, script in (("hot", hot or {}), ("cold", {})):
        recording.CALL_LOGS.pop(f"sampling/{name}", None)
        children.append({"name": name, **RECORDING, "config": {"log": f"sampling/{name}", "script": script},
                         **(hot_config if name == "hot" else {})})
    pipeline = {"version": 1, "name": "sampled", "metrics": {"sample_every": every}, "children": children,
                "tracing": {"enabled": tracing, "sample_ratio": 1.0, "granularity": granularity}}
    return composite_pair(vllm_config_with, pipeline)


def _forward_step(scheduler: Any, worker: Any) -> None:
    """A decode step of one request: it runs a forward pass, so nothing is flushed."""
    worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output(cached=["r1"])))
    worker.wait_for_save()
    worker.clear_connector_metadata()


def _idle_step(scheduler: Any, worker: Any) -> None:
    """The step vLLM runs once its requests finished: no forward pass, the stats are flushed."""
    worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output()))
    worker.clear_connector_metadata()


def _waits(stats: Any, child: str = "hot") -> int:
    return 0 if stats is None or stats.calls is None else stats.calls.call_count(child, "wait_for_save")


def test_one_step_in_sample_every_is_timed_and_counts_the_steps_before_it(vllm_config_with: Callable) -> None:
    scheduler, worker = _pair(vllm_config_with, every=4)
    for _ in range(10):
        _forward_step(scheduler, worker)
    assert _waits(worker.get_kv_connector_stats()) == 1 + 4 + 4  # steps 1, 5 and 9; the 10th counts later

    _idle_step(scheduler, worker)
    assert _waits(worker.get_kv_connector_stats()) == 1  # ... when the engine goes idle
    assert _waits(worker.get_kv_connector_stats(), "cold") == 0  # taken with the hot one's, above


def test_stats_taken_every_step_add_up_to_every_call_once_idle(vllm_config_with: Callable) -> None:
    scheduler, worker = _pair(vllm_config_with, every=8)
    counted = 0
    for _ in range(21):  # vLLM takes the stats after every step
        _forward_step(scheduler, worker)
        counted += _waits(worker.get_kv_connector_stats())
    assert counted < 21  # the calls since the last timed one are not counted yet
    _idle_step(scheduler, worker)
    assert counted + _waits(worker.get_kv_connector_stats()) == 21


def test_failed_calls_are_counted_as_calls_and_as_errors_whether_timed_or_not(vllm_config_with: Callable) -> None:
    scheduler, worker = _pair(vllm_config_with, every=4, hot={"raises": ["wait_for_save"]},
                              circuit_breaker={"enabled": False})
    for _ in range(6):
        _forward_step(scheduler, worker)
    _idle_step(scheduler, worker)
    stats = worker.get_kv_connector_stats()
    assert stats.calls.errors["hot"] == {"wait_for_save": {"ScriptedFailure": 6}}
    assert _waits(stats) == _waits(stats, "cold") == 6


def test_scheduler_counts_every_call_once_no_admitted_request_is_left(vllm_config_with: Callable) -> None:
    scheduler, _ = _pair(vllm_config_with, every=32)
    for index in range(3):
        request = make_request(f"r{index}")
        for _ in range(2):  # asked again while it waits for blocks
            scheduler.get_num_new_matched_tokens(request, 0)
        scheduler.update_state_after_alloc(request, make_blocks(1, 2), 0)
        scheduler.build_connector_meta(scheduler_output(new=[request]))
        scheduler.request_finished(request, [1, 2])
    calls = scheduler.get_kv_connector_stats().calls
    assert [calls.call_count("hot", op) for op in ("lookup", "update_state_after_alloc", "request_finished")] == [
        6, 3, 3]
    # One lookup in 32 is timed: the first; the 5 others count at its latency.
    lookups = [cell for cell in calls.cells if calls.operation_of(cell) == ("hot", "lookup")]
    assert len(lookups) == 1


def test_steps_that_move_a_traced_requests_kv_stand_for_themselves(vllm_config_with: Callable,
                                                                     exporter: Any) -> None:
    """Worker side, step granularity: each step saves a new traced request, so every call of it is timed and
    traced, and counted once, outside the sampling of the other steps."""
    scheduler, worker = _pair(vllm_config_with, every=4, tracing=True, granularity="step")
    for index in range(10):
        request = make_request(f"r{index}")
        scheduler.get_num_new_matched_tokens(request, 0)
        scheduler.update_state_after_alloc(request, make_blocks(1, 2), 0)
        worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output(new=[request])))
        worker.wait_for_save()
        worker.clear_connector_metadata()
        assert _waits(worker.get_kv_connector_stats()) == 1
    waits = [span for span in exporter.get_finished_spans() if span.name == "kvcompose.wait_for_save"]
    assert len(waits) == 2 * 10  # each child's, in every step
    steps = {span.context.span_id for span in exporter.get_finished_spans() if span.name == "kvcompose.step"}
    assert {span.parent.span_id for span in waits} <= steps


def test_after_the_engine_was_idle_the_next_step_is_timed(vllm_config_with: Callable) -> None:
    scheduler, worker = _pair(vllm_config_with, every=32)
    for _ in range(3):
        _forward_step(scheduler, worker)
    _idle_step(scheduler, worker)
    assert _waits(worker.get_kv_connector_stats()) == 3  # the first step, timed, and the two after it
    _forward_step(scheduler, worker)
    _idle_step(scheduler, worker)
    assert _waits(worker.get_kv_connector_stats()) == 1  # timed: it stands for itself alone


@pytest.mark.parametrize("every", [4, 1])
def test_traced_calls_are_counted_down_like_any_other(vllm_config_with: Callable, exporter: Any, every: int) -> None:
    """Every request traced: each lookup is a traced call, counted like an untraced one; one in
    ``sample_every`` is timed for the latency histogram as well. Each has its span either way."""
    scheduler, _ = _pair(vllm_config_with, every=every, tracing=True)
    for index in range(10):
        request = make_request(f"r{index}")
        scheduler.get_num_new_matched_tokens(request, 0)
        scheduler.request_finished(request, [])  # a request's lookup spans are recorded by its admission or end

    calls = scheduler.get_kv_connector_stats().calls  # no admitted request: the calls not timed count now
    assert calls.call_count("hot", "lookup") == 10
    assert len([span for span in exporter.get_finished_spans() if span.name == "kvcompose.lookup"]) == 2 * 10
