"""Every call into a child is timed: each call is in the latency histogram of its child and operation, with its
own duration, at the next take of the stats.

Driven step by step over scripted children, as vLLM orders the calls; a child
that sleeps a known time in one operation is the independent measure of its
latency.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvcompose.config import DEFAULT_LATENCY_BUCKETS, load_pipeline
from kvcompose.errors import PipelineConfigError
from kvcompose.testing import recording

from .connector_support import RECORDING, composite_pair, make_blocks, make_request, scheduler_output

# These tests read the stats a step at a time.
pytestmark = pytest.mark.usefixtures("tables_every_step")


def _pair(vllm_config_with: Callable, hot: dict[str, Any] | None = None, tracing: bool = False,
          granularity: str = "request", **hot_config: Any) -> tuple[Any, Any]:
    children = []
    for name, script in (("hot", hot or {}), ("cold", {})):
        recording.CALL_LOGS.pop(f"timing/{name}", None)
        children.append({"name": name, **RECORDING, "config": {"log": f"timing/{name}", "script": script},
                         **(hot_config if name == "hot" else {})})
    pipeline = {"version": 1, "name": "timed", "children": children,
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


def _latencies(stats: Any, child: str, operation: str) -> list[tuple[int, float]]:
    """(calls, seconds) of each latency bucket the child's calls of ``operation`` landed in."""
    calls = stats.calls
    return [entry for cell, entry in sorted(calls.cells.items()) if calls.operation_of(cell) == (child, operation)]


def test_every_step_is_counted_at_every_take(vllm_config_with: Callable) -> None:
    scheduler, worker = _pair(vllm_config_with)
    for _ in range(10):  # vLLM takes the stats after every step
        _forward_step(scheduler, worker)
        stats = worker.get_kv_connector_stats()
        assert _waits(stats) == _waits(stats, "cold") == 1


def test_each_call_lands_in_the_bucket_of_its_own_duration(vllm_config_with: Callable) -> None:
    """The hot child's wait_for_save sleeps 20 ms every step: each of its calls, and none of the cold child's,
    lands in a bucket above 20 ms, and the summed seconds are at least the sleeps'."""
    scheduler, worker = _pair(vllm_config_with, hot={"sleep_s": {"wait_for_save": 0.02}})
    for _ in range(5):
        _forward_step(scheduler, worker)
    stats = worker.get_kv_connector_stats()
    bounds = DEFAULT_LATENCY_BUCKETS
    hot = {cell % stats.calls.buckets: entry for cell, entry in stats.calls.cells.items()
           if stats.calls.operation_of(cell) == ("hot", "wait_for_save")}
    assert sum(count for count, _ in hot.values()) == 5
    assert all(bucket == len(bounds) or bounds[bucket] >= 0.02 for bucket in hot)
    assert sum(seconds for _, seconds in hot.values()) >= 5 * 0.02
    cold = _latencies(stats, "cold", "wait_for_save")
    assert sum(count for count, _ in cold) == 5
    assert sum(seconds for _, seconds in cold) < 5 * 0.02


def test_failed_calls_are_counted_as_calls_and_as_errors(vllm_config_with: Callable) -> None:
    scheduler, worker = _pair(vllm_config_with, hot={"raises": ["wait_for_save"]}, circuit_breaker={"enabled": False})
    for _ in range(6):
        _forward_step(scheduler, worker)
    _idle_step(scheduler, worker)
    stats = worker.get_kv_connector_stats()
    assert stats.calls.errors["hot"] == {"wait_for_save": {"ScriptedFailure": 6}}
    assert _waits(stats) == _waits(stats, "cold") == 6


def test_the_scheduler_counts_every_call_while_requests_run(vllm_config_with: Callable) -> None:
    scheduler, _ = _pair(vllm_config_with)
    for index in range(3):
        request = make_request(f"r{index}")
        for _ in range(2):  # asked again while it waits for blocks
            scheduler.get_num_new_matched_tokens(request, 0)
        scheduler.update_state_after_alloc(request, make_blocks(1, 2), 0)
        scheduler.build_connector_meta(scheduler_output(new=[request]))
        calls = scheduler.get_kv_connector_stats().calls  # the request is admitted and running
        assert [calls.call_count("hot", op) for op in ("lookup", "update_state_after_alloc")] == [2, 1]
        scheduler.request_finished(request, [1, 2])


def test_traced_steps_are_timed_once_and_traced(vllm_config_with: Callable, exporter: Any) -> None:
    """Worker side, step granularity: each step saves a new traced request; every call of it is timed once and
    has its span under the step."""
    scheduler, worker = _pair(vllm_config_with, tracing=True, granularity="step")
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


def test_traced_lookups_are_timed_and_traced(vllm_config_with: Callable, exporter: Any) -> None:
    scheduler, _ = _pair(vllm_config_with, tracing=True)
    for index in range(10):
        request = make_request(f"r{index}")
        scheduler.get_num_new_matched_tokens(request, 0)
        scheduler.request_finished(request, [])  # a request's lookup spans are recorded by its admission or end

    calls = scheduler.get_kv_connector_stats().calls
    assert calls.call_count("hot", "lookup") == 10
    assert len([span for span in exporter.get_finished_spans() if span.name == "kvcompose.lookup"]) == 2 * 10


def test_a_pipeline_that_still_sets_sample_every_is_told_what_changed() -> None:
    with pytest.raises(PipelineConfigError) as raised:
        load_pipeline({"version": 1, "name": "old", "metrics": {"sample_every": 32},
                       "children": [{"name": "c", "connector": "ExampleConnector"}]})
    (problem,) = raised.value.problems
    assert problem.path == ("metrics", "sample_every")
    assert "every call into a child is timed" in problem.message and "delete this key" in problem.message
