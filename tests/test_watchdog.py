"""The watchdog: a call into a child that runs long is seen while it runs, and its real duration is recorded.

A child's call is held by a gate in another thread; the test makes the
watchdog's looks itself, with the times it chooses, so what it sees is exact.
The real engine (a child sleeping under the OpenAI server) is in tests/test_faults_live.py.
"""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvcompose.config import LoggingSection
from kvcompose.connectors.watchdog import POLL_S, Watchdog
from kvcompose.logs import ROOT_LOGGER, configure_logging, get_logger
from kvcompose.testing import recording

from .connector_support import RECORDING, composite_pair, make_blocks, make_request, scheduler_output


@pytest.fixture
def logged() -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """kvcompose's log lines, as JSON objects (the pipelines below log JSON)."""
    get_logger("test")
    (handler,) = [h for h in logging.getLogger(ROOT_LOGGER).handlers if type(h) is logging.StreamHandler]
    sink = io.StringIO()
    previous = handler.setStream(sink)
    configure_logging(LoggingSection(format="json"))
    yield lambda: [json.loads(line) for line in sink.getvalue().splitlines()]
    handler.setStream(previous)
    configure_logging(LoggingSection())


def _pair(vllm_config_with: Callable, gated: str, key: str) -> tuple[Any, Any]:
    recording.CALL_LOGS.pop(f"watchdog/{key}", None)
    recording.GATES[key] = recording.Gate()
    children = [{"name": "hot", **RECORDING, "config": {"log": f"watchdog/{key}", "script": {
        "gates": {gated: key}, "matches": {"r1": [[16, False]]}}}}]
    # The composites' own watchdog is off: the test's Watchdog looks when the test says.
    pipeline = {"version": 1, "name": "watched", "watchdog_s": None, "children": children,
                "logging": {"format": "json"}}
    return composite_pair(vllm_config_with, pipeline)


def _held(call: Callable[[], Any], key: str) -> threading.Thread:
    """``call`` run in a thread until the gate ``key`` opens; returns once the child's call waits there."""
    thread = threading.Thread(target=call)
    thread.start()
    assert recording.GATES[key].entered.wait(10)
    return thread


def test_a_lookup_running_past_watchdog_s_is_logged_reported_and_recorded_when_it_returns(
    vllm_config_with: Callable, logged: Callable[[], list[dict[str, Any]]],
) -> None:
    scheduler, _ = _pair(vllm_config_with, "get_num_new_matched_tokens", "lookup")
    watchdog, reports = Watchdog(), []
    watchdog.watch(scheduler, "watched", "scheduler", scheduler._child_calls, watchdog_s=1.0,
                   on_running=reports.append)
    thread = _held(lambda: scheduler.get_num_new_matched_tokens(make_request("r1"), 0), "lookup")

    watchdog.look(now=100.0)  # first seen: running for half a look, at most
    assert reports == []
    watchdog.look(now=100.5)  # seen twice: running, not stuck yet
    assert reports == [{("hot", "lookup"): (pytest.approx(0.5 + POLL_S / 2), False)}]
    assert not [line for line in logged() if "running long" in line["event"]]
    watchdog.look(now=101.0)  # 1.0 s apart, so past 1 s (it started within the look before it was first seen)
    (warning,) = [line for line in logged() if line["event"] == "child call is running long"]
    assert (warning["level"], warning["connector"], warning["op"], warning["pipeline"]) == (
        "warning", "hot", "lookup", "watched")
    assert warning["running_s"] == pytest.approx(1.0 + POLL_S / 2, abs=0.01)
    assert any("recording.py" in frame and "pass_through" in frame for frame in warning["child_stack"])
    assert reports[-1] == {("hot", "lookup"): (pytest.approx(1.0 + POLL_S / 2), True)}

    recording.GATES["lookup"].open()
    thread.join(10)
    watchdog.look(now=101.5)
    assert reports[-1] == {}  # no call stuck any more
    (returned,) = [line for line in logged() if line["event"] == "child call returned after running long"]
    assert returned["ran_s"] == pytest.approx(1.0 + POLL_S / 2, abs=0.01)


def test_a_call_kvcompose_times_itself_is_not_recorded_twice(vllm_config_with: Callable) -> None:
    """Every call is timed by kvcompose: a wait_for_save the watchdog sees running long is recorded once, with its
    real duration, and the watchdog leaves the recording alone."""
    scheduler, worker = _pair(vllm_config_with, "wait_for_save", "save")
    request = make_request("r1")
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(1, 2), 0)
    worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output(new=[request])))
    watchdog = Watchdog()
    watchdog.watch(worker, "watched", "worker", worker._child_calls, watchdog_s=0.1)
    thread = _held(worker.wait_for_save, "save")
    for now in (10.0, 10.5, 11.0):
        watchdog.look(now=now)
    recording.GATES["save"].open()
    thread.join(10)
    watchdog.look(now=11.5)
    worker.clear_connector_metadata()
    calls = worker.get_kv_connector_stats().calls
    assert calls.call_count("hot", "wait_for_save") == 1  # once, by kvcompose's own timing
    assert calls.by_operation()[("hot", "wait_for_save")][1] < 1.0  # its real duration, not the looks' 1.125 s


def test_the_watchdog_sees_nothing_in_a_composite_between_calls(vllm_config_with: Callable) -> None:
    scheduler, _ = _pair(vllm_config_with, "get_num_new_matched_tokens", "idle")
    watchdog, reports = Watchdog(), []
    watchdog.watch(scheduler, "watched", "scheduler", scheduler._child_calls, watchdog_s=0.0,
                   on_running=reports.append)
    for now in (1.0, 2.0, 3.0):
        watchdog.look(now=now)
    assert reports == []
