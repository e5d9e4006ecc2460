"""on_error and the circuit breaker, driven call by call over scripted children.

A failing child never stops the others; what it cannot do is reported to vLLM
the way vLLM repairs it: a failed load as blocks to recompute (sync) or a
failed receive (async), a failed async save as done so the blocks are freed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvcompose.connectors.isolation import BreakerState
from kvcompose.testing import recording
from kvcompose.testing.steps import forward_step
from kvcompose.wire.calls import CallTable

from .connector_support import RECORDING, composite_pair, make_blocks, make_request, scheduler_output


def _pair(vllm_config_with: Callable, scripts: dict[str, dict[str, Any]], metrics: bool = True,
          **hot: Any) -> tuple[Any, Any]:
    children = []
    for name, script in scripts.items():
        key = f"isolation/{name}"
        recording.CALL_LOGS.pop(key, None)
        children.append({"name": name, **RECORDING, "config": {"log": key, "script": script},
                         **(hot if name == "hot" else {})})
    return composite_pair(vllm_config_with, {"version": 1, "name": "iso", "metrics": {"enabled": metrics},
                                             "children": children})


def _calls(name: str, method: str) -> int:
    return sum(1 for entry in recording.CALL_LOGS[f"isolation/{name}"] if entry[0] == method)


def _step(scheduler: Any, worker: Any, new: list[Any] = (), finished: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
    worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output(new=new)))
    results, load_errors = forward_step(worker, finished=finished)
    worker.clear_connector_metadata()
    return {"sent": results.finished_sending, "received": results.finished_recving,
            "failed": results.failed_recving, "load_errors": load_errors}


def _hit(scheduler: Any, request: Any, local: int = 0, blocks: tuple[int, ...] = (1, 2, 3)) -> tuple[int | None, bool]:
    answer = scheduler.get_num_new_matched_tokens(request, local)
    scheduler.update_state_after_alloc(request, make_blocks(*blocks), answer[0])
    return answer


def test_failed_lookup_is_a_miss_and_the_next_child_answers(vllm_config_with: Callable) -> None:
    scheduler, _ = _pair(vllm_config_with, {"hot": {"raises": ["get_num_new_matched_tokens"]},
                                            "cold": {"matches": {"r1": [[32, False]]}}})
    request = make_request("r1")
    assert _hit(scheduler, request) == (32, False)
    scheduler.build_connector_meta(scheduler_output(new=[request], blocks=[1, 2, 3]))  # the first step: stats go out
    stats = scheduler.get_kv_connector_stats()
    assert stats.calls.errors == {"hot": {"lookup": {"ScriptedFailure": 1}}}
    assert stats.calls.counter("cold", "lookup_hits") == 1


def test_with_metrics_off_a_failed_lookup_is_a_miss_and_the_next_child_loads(vllm_config_with: Callable) -> None:
    """Metrics off, the composite's lookup keeps only the chosen answer: the load still goes to that child."""
    scheduler, worker = _pair(vllm_config_with, {"hot": {"raises": ["get_num_new_matched_tokens"]},
                                                 "cold": {"matches": {"r1": [[32, False]]}}}, metrics=False)
    request = make_request("r1")
    assert _hit(scheduler, request) == (32, False)
    allocations = [entry for entry in recording.CALL_LOGS["isolation/cold"] if entry[0] == "update_state_after_alloc"]
    assert allocations[-1][-1] == 32  # the cold child loads the 32 tokens
    assert _step(scheduler, worker, new=[request])["load_errors"] == set()
    scheduler.request_finished(request, [1, 2, 3])
    assert scheduler.request_state_sizes() == {}


def test_failed_saves_do_not_stop_the_other_child(vllm_config_with: Callable) -> None:
    scheduler, worker = _pair(vllm_config_with, {"hot": {"raises": ["save_kv_layer", "wait_for_save"]}, "cold": {}})
    _step(scheduler, worker, new=[make_request("r1")])
    assert _calls("hot", "save_kv_layer") == 2  # tried on both layers
    assert _calls("cold", "save_kv_layer") == 2 and _calls("cold", "wait_for_save") == 1
    # Counted whether timed or not (per-layer calls are timed only with metrics.per_layer).
    assert worker.get_kv_connector_stats().calls.errors == {
        "hot": {"save_kv_layer": {"ScriptedFailure": 2}, "wait_for_save": {"ScriptedFailure": 1}}}


def test_on_error_raise_lets_the_error_reach_vllm(vllm_config_with: Callable) -> None:
    _, worker = _pair(vllm_config_with, {"hot": {"raises": ["save_kv_layer"]}, "cold": {}}, on_error="raise")
    with pytest.raises(recording.ScriptedFailure):
        worker.save_kv_layer("layer.0", None, None)
    assert _calls("cold", "save_kv_layer") == 0


@pytest.mark.parametrize("failing", ["start_load_kv", "wait_for_layer_load", "bind_connector_metadata",
                                     "get_block_ids_with_load_errors", "update_state_after_alloc",
                                     "build_connector_meta"])
def test_a_load_the_child_cannot_make_is_reported_for_recompute(
    vllm_config_with: Callable, base_vllm_config: Any, failing: str
) -> None:
    block = base_vllm_config.cache_config.block_size
    scheduler, worker = _pair(vllm_config_with, {"hot": {"matches": {"r1": [[2 * block, False]]}, "raises": [failing]},
                                                 "cold": {}})
    request = make_request("r1")
    assert _hit(scheduler, request, local=block, blocks=(7, 8, 9, 10)) == (2 * block, False)
    # One local block (7); the loaded tokens go to the next two.
    assert _step(scheduler, worker, new=[request])["load_errors"] == {8, 9}
    assert worker.get_kv_connector_stats().calls.load_error_blocks("hot") == 2
    if failing != "get_block_ids_with_load_errors":  # known before the layers ran
        assert _calls("cold", "save_kv_layer") == 0  # nothing computed over unfilled blocks is stored
    assert _step(scheduler, worker)["load_errors"] == set()  # reported once
    assert _calls("cold", "save_kv_layer") >= 2  # the next step saves again


def test_an_async_load_the_child_cannot_make_is_a_failed_receive(vllm_config_with: Callable) -> None:
    scheduler, worker = _pair(vllm_config_with, {"hot": {"matches": {"r1": [[32, True]]},
                                                         "raises": ["get_transfer_results"]}, "cold": {}})
    request = make_request("r1")
    assert _hit(scheduler, request) == (32, True)
    outcome = _step(scheduler, worker)
    assert outcome["failed"] == {"r1"} and outcome["received"] == {"r1"}
    assert outcome["load_errors"] == set()
    assert _step(scheduler, worker)["failed"] == set()


def test_async_save_is_reported_once_when_one_saver_fails(vllm_config_with: Callable) -> None:
    scheduler, worker = _pair(vllm_config_with, {
        "hot": {"async_saves": ["r1"], "raises": ["get_transfer_results"]},
        "cold": {"async_saves": ["r1"], "finished_sending": [[], ["r1"]]},
    })
    request = make_request("r1")
    assert scheduler.request_finished(request, [1, 2]) == (True, None)
    first = _step(scheduler, worker, finished={"r1"})
    second = _step(scheduler, worker)
    assert first["sent"] == set()  # hot gave up, cold still owes it
    assert second["sent"] == {"r1"}
    assert "owed_saves" not in worker.request_state_sizes()


def test_circuit_opens_skips_the_child_then_probes_and_closes(vllm_config_with: Callable) -> None:
    breaker = {"failures": 2, "cooldown_s": 0.2}
    scheduler, worker = _pair(vllm_config_with, {"hot": {"raises": ["get_num_new_matched_tokens", "save_kv_layer"]},
                                                 "cold": {}}, circuit_breaker=breaker)

    for index in range(5):
        scheduler.get_num_new_matched_tokens(make_request(f"r{index}"), 0)
    assert _calls("hot", "get_num_new_matched_tokens") == 2  # opened after 2 failures, then skipped
    assert scheduler.get_kv_connector_stats().breakers["hot"] == {"state": BreakerState.OPEN, "opens": 1}

    for layer in range(4):
        worker.save_kv_layer(f"layer.{layer}", None, None)
    assert _calls("hot", "save_kv_layer") == 2
    assert _calls("cold", "save_kv_layer") == 4
    assert [worker._child_calls.owner(save).name for save in worker._calls.save_kv_layer] == ["cold"]  # left out

    time.sleep(0.25)
    scheduler.children[0].connector.script["raises"] = []  # the tier recovers
    scheduler.get_num_new_matched_tokens(make_request("probe"), 0)
    scheduler.get_num_new_matched_tokens(make_request("after"), 0)
    assert _calls("hot", "get_num_new_matched_tokens") == 4
    assert scheduler.get_kv_connector_stats().breakers["hot"] == {"state": BreakerState.CLOSED, "opens": 0}
    scheduler.get_num_new_matched_tokens(make_request("later"), 0)
    stats = scheduler.get_kv_connector_stats()  # None: that lookup was not one to time, and nothing else changed
    assert stats is None or "hot" not in stats.breakers  # closed and unchanged: not reported


def test_an_open_circuit_still_lets_calls_that_are_never_isolated_through(vllm_config_with: Callable) -> None:
    """Shutdown (and the start-up calls) are never isolated, so never skipped: the chaos matrix caught an
    open circuit refusing a child its shutdown."""
    scheduler, _ = _pair(vllm_config_with, {"hot": {"raises": ["get_num_new_matched_tokens"]}, "cold": {}},
                         circuit_breaker={"failures": 1, "cooldown_s": 60})
    scheduler.get_num_new_matched_tokens(make_request("a"), 0)
    assert scheduler.get_kv_connector_stats().breakers["hot"]["state"] == BreakerState.OPEN
    scheduler.shutdown()
    assert _calls("hot", "shutdown") == _calls("cold", "shutdown") == 1


def test_a_failed_probe_opens_the_circuit_again(vllm_config_with: Callable) -> None:
    # A cool-down far longer than two calls take on a loaded machine: "c" must come before it ends.
    breaker = {"failures": 1, "cooldown_s": 1.0}
    scheduler, _ = _pair(vllm_config_with, {"hot": {"raises": ["get_num_new_matched_tokens"]}, "cold": {}},
                         circuit_breaker=breaker)
    scheduler.get_num_new_matched_tokens(make_request("a"), 0)
    time.sleep(1.05)
    scheduler.get_num_new_matched_tokens(make_request("b"), 0)  # the probe fails
    scheduler.get_num_new_matched_tokens(make_request("c"), 0)  # skipped again
    assert _calls("hot", "get_num_new_matched_tokens") == 2
    assert scheduler.get_kv_connector_stats().breakers["hot"] == {"state": BreakerState.OPEN, "opens": 2}


def test_nothing_stays_behind_after_requests_finish(vllm_config_with: Callable) -> None:
    scheduler, worker = _pair(vllm_config_with, {"hot": {"matches": {"r1": [[32, False]]}, "async_saves": ["r1"],
                                                         "finished_sending": [[], ["r1"]]}, "cold": {}})
    request = make_request("r1")
    _hit(scheduler, request)
    _step(scheduler, worker, new=[request])
    scheduler.request_finished(request, [1, 2])
    _step(scheduler, worker)
    _step(scheduler, worker)
    assert scheduler.request_state_sizes() == worker.request_state_sizes() == {}


def test_breaker_changes_are_span_events_even_outside_a_traced_call(vllm_config_with: Callable) -> None:
    from kvcompose.tracing import set_span_exporter

    from .span_support import FlushedSpans

    exporter = FlushedSpans()
    set_span_exporter(exporter)
    try:
        scripts = {"hot": {"raises": ["save_kv_layer"]}, "cold": {}}
        children = [{"name": name, **RECORDING, "config": {"log": f"isolation/{name}", "script": script},
                     "circuit_breaker": {"failures": 1}} for name, script in scripts.items()]
        _, worker = composite_pair(vllm_config_with, {"version": 1, "name": "iso", "tracing": {"enabled": True},
                                                      "children": children})
        worker.save_kv_layer("layer.0", None, None)  # per-layer calls make no span at request granularity
    finally:
        set_span_exporter(None)
    (span,) = exporter.get_finished_spans()
    assert span.name == "kvcompose.circuit_breaker"
    assert [(event.name, dict(event.attributes)) for event in span.events] == [
        ("kvcompose.circuit_breaker", {"kvcompose.connector.name": "hot", "state": "open"})]


def _breaker(connector: Any, child: str = "hot") -> dict[str, int] | None:
    """The child's breaker report in the connector's next stats (None: closed and unchanged)."""
    stats = connector.get_kv_connector_stats()
    return stats.breakers.get(child) if stats is not None else None


def _errors(connector: Any) -> dict[str, Any]:
    stats = connector.get_kv_connector_stats()
    calls: CallTable | None = stats.calls if stats is not None else None
    return calls.errors if calls is not None else {}


def test_cheap_successes_do_not_keep_a_failing_lookup_circuit_closed(vllm_config_with: Callable) -> None:
    from vllm.v1.outputs import KVConnectorOutput

    scheduler, _ = _pair(vllm_config_with, {"hot": {"raises": ["get_num_new_matched_tokens"]}, "cold": {}},
                         circuit_breaker={"failures": 5, "cooldown_s": 60})
    for index in range(1000):  # a scheduler step each: a lookup, then the per-step calls, which succeed
        scheduler.get_num_new_matched_tokens(make_request(f"r{index}"), 0)
        scheduler.build_connector_meta(scheduler_output())
        scheduler.update_connector_output(KVConnectorOutput())
        scheduler.has_pending_block_frees()
        list(scheduler.take_events())
    assert _calls("hot", "get_num_new_matched_tokens") == 5  # opened by the fifth failure in a row
    assert _calls("hot", "build_connector_meta") == 4  # skipped too once open
    assert _breaker(scheduler) == {"state": BreakerState.OPEN, "opens": 1}


def test_failures_of_housekeeping_calls_are_counted_but_never_open_the_circuit(vllm_config_with: Callable) -> None:
    from vllm.v1.outputs import KVConnectorOutput

    scheduler, _ = _pair(vllm_config_with, {"hot": {"raises": ["update_connector_output"]}, "cold": {}},
                         circuit_breaker={"failures": 2})
    for _ in range(10):
        scheduler.update_connector_output(KVConnectorOutput())
    assert _calls("hot", "update_connector_output") == 10
    assert _errors(scheduler) == {"hot": {"update_connector_output": {"ScriptedFailure": 10}}}
    assert _breaker(scheduler) is None


def test_half_open_lets_one_data_path_probe_decide(vllm_config_with: Callable) -> None:
    scheduler, _ = _pair(vllm_config_with, {"hot": {"raises": ["get_num_new_matched_tokens"]}, "cold": {}},
                         circuit_breaker={"failures": 1, "cooldown_s": 0.1})
    scheduler.get_num_new_matched_tokens(make_request("a"), 0)  # opens
    time.sleep(0.15)
    scheduler.children[0].connector.script["raises"] = []
    scheduler.build_connector_meta(scheduler_output())  # a housekeeping call goes through: half open
    assert _calls("hot", "build_connector_meta") == 1
    assert _breaker(scheduler) == {"state": BreakerState.HALF_OPEN, "opens": 1}  # its success closes nothing

    # While the probe runs, other lookups skip the child.
    gate = recording.GATES["probe"] = recording.Gate()
    scheduler.children[0].connector.script["gates"] = {"get_num_new_matched_tokens": "probe"}
    probe = threading.Thread(target=scheduler.get_num_new_matched_tokens, args=(make_request("probe"), 0))
    probe.start()
    try:
        assert gate.entered.wait(30)
        assert [scheduler.get_num_new_matched_tokens(make_request(f"during{i}"), 0) for i in range(3)] == [
            (0, False)] * 3
    finally:
        gate.open()
        probe.join(30)
    assert _calls("hot", "get_num_new_matched_tokens") == 2  # the opening failure and the probe
    assert _calls("cold", "get_num_new_matched_tokens") == 5
    assert _breaker(scheduler) == {"state": BreakerState.CLOSED, "opens": 0}


def test_per_layer_outcomes_count_for_the_breaker(vllm_config_with: Callable) -> None:
    _, worker = _pair(vllm_config_with, {"hot": {}, "cold": {}}, circuit_breaker={"failures": 2, "cooldown_s": 60})
    hot = worker.children[0].connector
    for layer in range(6):  # every other layer fails: never two in a row
        hot.script["raises"] = ["save_kv_layer"] if layer % 2 == 0 else []
        worker.save_kv_layer(f"layer.{layer}", None, None)
    assert _calls("hot", "save_kv_layer") == 6 and _breaker(worker) is None
    hot.script["raises"] = ["save_kv_layer"]
    for layer in range(6, 9):
        worker.save_kv_layer(f"layer.{layer}", None, None)
    assert _calls("hot", "save_kv_layer") == 8  # two failures in a row opened it
    assert _breaker(worker) == {"state": BreakerState.OPEN, "opens": 1}
    assert _calls("cold", "save_kv_layer") == 9


def test_saves_stay_off_for_the_step_of_a_failed_load_when_a_circuit_opens(
    vllm_config_with: Callable, base_vllm_config: Any
) -> None:
    block = base_vllm_config.cache_config.block_size
    scripts = {"hot": {"matches": {"r1": [[2 * block, False]]}, "raises": ["start_load_kv"]},
               "cold": {"raises": ["wait_for_layer_load"]}}
    breakers = {"hot": {"failures": 5}, "cold": {"failures": 1, "cooldown_s": 60}}
    children = []
    for name, script in scripts.items():
        recording.CALL_LOGS.pop(f"isolation/{name}", None)
        children.append({"name": name, **RECORDING, "config": {"log": f"isolation/{name}", "script": script},
                         "circuit_breaker": breakers[name]})
    scheduler, worker = composite_pair(vllm_config_with, {"version": 1, "name": "iso", "children": children})
    request = make_request("r1")
    _hit(scheduler, request, blocks=(7, 8))
    outcome = _step(scheduler, worker, new=[request])  # hot's load fails; cold's circuit opens on layer 0
    assert outcome["load_errors"] == {7, 8}
    assert _breaker(worker, "cold")["state"] == BreakerState.OPEN
    assert _calls("hot", "save_kv_layer") == _calls("cold", "save_kv_layer") == 0
    _step(scheduler, worker)
    assert _calls("hot", "save_kv_layer") == 2  # saves again the next step (cold's circuit is still open)


def test_a_failure_while_events_are_iterated_is_isolated(vllm_config_with: Callable) -> None:
    scheduler, _ = _pair(vllm_config_with, {"hot": {"events": [[1], [2], [3]], "events_fail_after": 2},
                                            "cold": {"events": [[9]]}})
    events = scheduler.take_events()  # iterated by vLLM's scheduler, after the call returned
    collected = list(events) if events else []
    assert [event.block_hashes for event in collected] == [[1], [2], [9]]  # hot's events so far, then cold's
    assert _errors(scheduler) == {"hot": {"take_events": {"ScriptedFailure": 1}}}


def test_children_shut_down_when_the_instrumentation_fails_to_close(
    vllm_config_with: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler, _ = _pair(vllm_config_with, {"hot": {}, "cold": {}})

    def fail_to_close() -> None:
        raise RuntimeError("collector gone")

    monkeypatch.setattr(scheduler._instrumentation, "close", fail_to_close)
    with pytest.raises(RuntimeError, match="collector gone"):
        scheduler.shutdown()
    assert _calls("hot", "shutdown") == _calls("cold", "shutdown") == 1


def test_a_worker_circuit_turns_half_open_only_when_a_step_starts() -> None:
    """Mid-step, a child whose circuit was open has not been given the step's metadata: its probe would
    fail for that alone (the real-engine breaker test caught it), so the worker probes after a bind."""
    from kvcompose.config import ChildConfig
    from kvcompose.connectors.isolation import ChildGuard
    from kvcompose.operations import OPERATIONS

    start_load = OPERATIONS["start_load_kv"]
    calls: list[int] = []

    def start_load_kv(step: int) -> None:
        calls.append(step)
        if step == 1:
            raise OSError("tier down")

    bound: dict[str, Callable[[int], None]] = {}

    def bind(guard: ChildGuard, state_changed: bool) -> None:  # what the composite does on a change
        bound["start_load_kv"] = guard.gate(start_load, start_load_kv)

    guard = ChildGuard(ChildConfig(name="hot", connector="ExampleConnector",
                                   circuit_breaker={"failures": 1, "cooldown_s": 0.05}), on_change=bind)
    guard.half_open_at_step_start = True
    bind(guard, False)

    def guarded(step: int) -> None:  # as the composite's loop makes the call
        try:
            bound["start_load_kv"](step)
        except Exception as error:
            guard.answer(start_load, error)

    guarded(1)  # fails: the circuit opens
    time.sleep(0.06)
    guarded(2)  # the cool-down has passed, but mid-step: still skipped
    assert (calls, guard.state) == ([1], BreakerState.OPEN)
    guard.step_started()  # the next step binds its metadata first
    guarded(3)  # the probe succeeds
    assert (calls, guard.state) == ([1, 3], BreakerState.CLOSED)
