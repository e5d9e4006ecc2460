"""When kvcompose's tables go out in vLLM's stats: once a second while the engine works, and at once as it
goes idle, decided by the scheduler side so every worker sends at the same step. Nothing is lost in between:
every call the children saw (their own call logs) is in the tables, once."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from kvcompose.instrumentation import scheduler as scheduler_instrumentation
from kvcompose.testing import recording

from .connector_support import RECORDING, composite_pair, make_blocks, make_request, scheduler_output


def _pair(vllm_config_with: Callable, log: str) -> tuple[Any, Any]:
    recording.CALL_LOGS.pop(log, None)
    pipeline = {"version": 1, "name": "cadence", "children": [{"name": "tier", **RECORDING, "config": {"log": log}}]}
    return composite_pair(vllm_config_with, pipeline)


def _step(scheduler: Any, worker: Any, output: Any, workers: tuple[Any, ...] = ()) -> list[Any]:
    """One engine step on ``worker`` (and ``workers``, bound to the same metadata); each one's stats."""
    metadata = scheduler.build_connector_meta(output)
    taken = []
    for one in (worker, *workers):
        one.bind_connector_metadata(metadata)
        one.wait_for_save()
        taken.append(one.get_kv_connector_stats())
        one.clear_connector_metadata()
    return taken


def _waits_sent(stats: Any) -> int:
    return 0 if stats is None or stats.calls is None else stats.calls.call_count("tier", "wait_for_save")


def _waits_seen(log: str) -> int:
    return sum(1 for entry in recording.CALL_LOGS[log] if entry[0] == "wait_for_save")


def test_tables_wait_for_the_second_and_go_out_whole_as_the_engine_goes_idle(vllm_config_with: Callable) -> None:
    scheduler, worker = _pair(vllm_config_with, "cadence/idle")
    request = make_request("r1")
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(1, 2), 0)
    sent = [_step(scheduler, worker, scheduler_output(new=[request], blocks=[1, 2]))[0]]
    assert _waits_sent(sent[0]) == 1  # the engine's first step sends at once
    for _ in range(5):  # within the second: the steps' calls are held
        sent += _step(scheduler, worker, scheduler_output(cached=["r1"]))
    assert [_waits_sent(stats) for stats in sent[1:]] == [0] * 5
    scheduler.request_finished(request, [1, 2])
    sent += _step(scheduler, worker, scheduler_output())  # the step after the last request: no forward pass
    assert _waits_sent(sent[-1]) == 5 + 1  # the held steps' calls, and this step's own
    assert sum(map(_waits_sent, sent)) == _waits_seen("cadence/idle") == 7


def test_tables_go_out_again_once_the_second_passed(
    vllm_config_with: Callable, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scheduler_instrumentation, "TABLES_EVERY_S", 0.05)
    scheduler, worker = _pair(vllm_config_with, "cadence/second")
    request = make_request("r1")
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(1, 2), 0)
    first = _step(scheduler, worker, scheduler_output(new=[request], blocks=[1, 2]))[0]
    held = _step(scheduler, worker, scheduler_output(cached=["r1"]))[0]
    time.sleep(0.06)  # past TABLES_EVERY_S: the next step's metadata tells the worker to send
    due = _step(scheduler, worker, scheduler_output(cached=["r1"]))[0]
    assert (_waits_sent(first), _waits_sent(held), _waits_sent(due)) == (1, 0, 2)
    assert _waits_seen("cadence/second") == 3


def test_the_scheduler_sends_its_lookups_at_the_same_steps(vllm_config_with: Callable) -> None:
    scheduler, worker = _pair(vllm_config_with, "cadence/scheduler")
    first, second = make_request("r1"), make_request("r2")
    for request, blocks in ((first, [1, 2]), (second, [3, 4])):
        scheduler.get_num_new_matched_tokens(request, 0)
        scheduler.update_state_after_alloc(request, make_blocks(*blocks), 0)
        _step(scheduler, worker, scheduler_output(new=[request], blocks=blocks))
        if request is first:
            taken = scheduler.get_kv_connector_stats()  # the first step was due
            assert taken.calls.call_count("tier", "lookup") == 1
    assert scheduler.get_kv_connector_stats() is None  # the second request's step was not
    for request in (first, second):
        scheduler.request_finished(request, [])
    idle = scheduler.get_kv_connector_stats()  # no admitted request left: what it holds goes out
    assert idle.calls.call_count("tier", "lookup") == 1


def test_every_worker_sends_at_the_step_the_scheduler_chose(vllm_config_with: Callable) -> None:
    """Tensor parallelism: vLLM merges the workers' stats of one step, and a block that failed to load on
    several workers counts once only if they all send that step's tables together."""
    scheduler, worker = _pair(vllm_config_with, "cadence/workers")
    _, other_worker = _pair(vllm_config_with, "cadence/workers")
    request = make_request("r1")
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(1, 2), 0)
    steps = [_step(scheduler, worker, scheduler_output(new=[request], blocks=[1, 2]), (other_worker,))]
    steps += [_step(scheduler, worker, scheduler_output(cached=["r1"]), (other_worker,)) for _ in range(3)]
    steps.append(_step(scheduler, worker, scheduler_output(), (other_worker,)))
    assert [[_waits_sent(stats) for stats in step] for step in steps] == [[1, 1], [0, 0], [0, 0], [0, 0], [4, 4]]
