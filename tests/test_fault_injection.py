"""FaultInjectionConnector: its settings, seeded faults, lies, and one real engine.

The inner connector is a RecordingConnector (its call log shows what reached
it) or, in the engine test, vLLM's ExampleConnector.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import logging.handlers
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcompose.errors import PipelineConfigError
from kvcompose.faults import FAULT_OPERATIONS, fault_injection_config
from kvcompose.testing import recording
from kvcompose.testing.tiny_model import prompt_words

FAULT_INJECTION = {"connector": "FaultInjectionConnector", "module_path": "kvcompose.connectors"}
RECORDING = {"connector": "RecordingConnector", "module_path": "kvcompose.testing.recording"}


def _recording_inner(log: str, script: dict[str, Any] | None = None) -> dict[str, Any]:
    recording.CALL_LOGS.pop(log, None)
    return {**RECORDING, "config": {"log": log, "script": script or {}}}


def _build(vllm_config_with: Callable, role_name: str, settings: dict[str, Any]) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcompose.connectors import FaultInjectionConnector

    config = vllm_config_with({
        "kv_connector": FAULT_INJECTION["connector"], "kv_connector_module_path": FAULT_INJECTION["module_path"],
        "kv_role": "kv_both", "kv_connector_extra_config": settings,
    })
    return FaultInjectionConnector(config, KVConnectorRole[role_name], None)


def _request(request_id: str) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id, list(range(64)), SamplingParams(max_tokens=4), None)


def _blocks(*block_ids: int) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(i) for i in block_ids],))


def _problem(settings: dict[str, Any]) -> tuple[tuple[Any, ...], str]:
    with pytest.raises(PipelineConfigError) as caught:
        fault_injection_config(settings)
    (problem,) = caught.value.problems
    return problem.path, problem.message


INNER = {"connector": "ExampleConnector", "config": {"shared_storage_path": "/tmp/x"}}


# ---------------------------------------------------------------- settings


def test_the_issue_example_is_valid() -> None:
    config = fault_injection_config({
        "seed": 7, "inner": INNER,
        "faults": {
            "raise": {"save_kv_layer": 0.5, "start_load_kv": 0.2, "get_num_new_matched_tokens": 0.1},
            "latency": {"wait_for_save": {"probability": 1.0, "seconds": 0.01}},
            "lie": 0.3,
        },
    })
    assert config.faults.raise_["save_kv_layer"] == 0.5
    assert config.faults.latency["wait_for_save"].seconds == 0.01
    assert config.inner.connector == "ExampleConnector" and config.inner.config == {"shared_storage_path": "/tmp/x"}


def test_an_unknown_operation_is_named_with_a_suggestion_and_the_allowed_list() -> None:
    path, message = _problem({"inner": INNER, "faults": {"raise": {"save_kv_layr": 0.5}}})
    assert path == ("faults", "raise")
    assert "unknown operation 'save_kv_layr'; did you mean 'save_kv_layer'?" in message
    assert all(operation in message for operation in FAULT_OPERATIONS)
    path, message = _problem({"inner": INNER, "faults": {"latency": {"nap": {"seconds": 1}}}})
    assert path == ("faults", "latency") and message.startswith("unknown operation 'nap' (allowed: ")


@pytest.mark.parametrize(
    ("settings", "path", "words"),
    [
        ({"inner": INNER, "faults": {"raise": {"wait_for_save": 1.5}}}, ("faults", "raise", "wait_for_save"), "1"),
        ({"inner": INNER, "faults": {"lie": -0.1}}, ("faults", "lie"), "greater than or equal to 0"),
        ({"inner": INNER, "faults": {"lies": 0.3}}, ("faults", "lies"), "unknown key"),
        ({"inner": INNER, "fault": {}}, ("fault",), "unknown key"),
        ({"faults": {}}, ("inner",), "required key is missing"),
        ({"inner": INNER, "faults": {"latency": {"wait_for_save": {"probability": 1.0}}}},
         ("faults", "latency", "wait_for_save", "seconds"), "required key is missing"),
        ({"inner": INNER, "faults": {"latency": {"wait_for_save": {"seconds": float("inf")}}}},
         ("faults", "latency", "wait_for_save", "seconds"), "finite"),
        ({"inner": {"config": {}}}, ("inner", "connector"), "required key is missing"),
        ({"inner": {**INNER, "transfer": {"kv_role": "kv_both"}}}, ("inner", "transfer"), "set by kvcompose"),
        ({"inner": {**INNER, "load": False}}, ("inner",), "'load' belongs on the pipeline child"),
        ({"inner": INNER, "seed": "seven"}, ("seed",), "integer"),
    ],
)
def test_bad_settings_name_the_field(settings: dict[str, Any], path: tuple[Any, ...], words: str) -> None:
    problem_path, message = _problem(settings)
    assert problem_path == path
    assert words in message


def test_bad_settings_stop_the_connector_and_name_the_pipeline_child(vllm_config_with: Callable) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcompose.connectors import KVComposeConnector
    from kvcompose.connectors.children import ChildStartupError

    with pytest.raises(PipelineConfigError, match=r"faults\.lie"):
        _build(vllm_config_with, "WORKER", {"inner": INNER, "faults": {"lie": 2}})
    with pytest.raises(ValueError, match="inner connector 'ExampleConector' cannot be loaded"):
        _build(vllm_config_with, "WORKER", {"inner": {"connector": "ExampleConector"}})
    pipeline = {"version": 1, "name": "p", "children": [
        {"name": "flaky", **FAULT_INJECTION, "config": {"inner": INNER, "faults": {"raise": {"nope": 1}}}},
    ]}
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}})
    with pytest.raises(ChildStartupError, match=r"child 'flaky' .* faults\.raise: unknown operation 'nope'"):
        KVComposeConnector(config, KVConnectorRole.WORKER, None)


# ---------------------------------------------------------------- forwarding


def test_every_connector_method_is_forwarded_and_can_fail() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvcompose.connectors import FaultInjectionConnector

    methods = {
        name for name, value in vars(KVConnectorBase_V1).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }
    # has_connector_metadata reads the injector's own bound metadata. FAULT_OPERATIONS
    # also has what later vLLM releases add (test_conformance checks them all).
    assert methods - {"has_connector_metadata"} <= set(FAULT_OPERATIONS)
    assert all(name in vars(FaultInjectionConnector) for name in FAULT_OPERATIONS)
    assert not FaultInjectionConnector.__abstractmethods__


@pytest.mark.parametrize("operation", FAULT_OPERATIONS)
def test_a_certain_fault_raises_before_the_inner_connector_is_called(
    vllm_config_with: Callable, operation: str
) -> None:
    from kvcompose.faults import InjectedFault

    log = f"every-op/{operation}"
    connector = _build(vllm_config_with, "WORKER", {"inner": _recording_inner(log),
                                                    "faults": {"raise": {operation: 1.0}}})
    if not hasattr(type(connector.inner), operation):  # added after the installed vLLM, which never calls it
        assert not hasattr(connector, operation)
        return
    method = getattr(connector, operation)
    arguments = [  # a real request where one is asked for: the injector drops its state for it first
        _request("r1") if p.name == "request" else None
        for p in inspect.signature(getattr(type(connector.inner), operation)).parameters.values()
        if p.name != "self" and p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    with pytest.raises(InjectedFault, match=operation):
        method(*arguments)
    assert recording.CALL_LOGS[log] == []


def test_without_faults_calls_reach_the_inner_connector_unchanged(vllm_config_with: Callable) -> None:
    log = "plain"
    script = {"load_errors": [4], "finished_sending": [["r1"]], "worker_meta": True}
    worker = _build(vllm_config_with, "WORKER", {"inner": _recording_inner(log, script)})
    assert worker.get_transfer_results({"r1"}).finished_sending == {"r1"}
    assert worker.get_block_ids_with_load_errors() == {4}
    assert worker.build_connector_worker_meta().count == 1
    worker.save_kv_layer("layer.0", None, None)
    worker.shutdown()
    # No faults: the forwarded per-layer call is the inner connector's bound method itself.
    assert worker.save_kv_layer == worker.inner.save_kv_layer
    assert [entry[0] for entry in recording.CALL_LOGS[log]] == [
        "get_transfer_results", "get_block_ids_with_load_errors", "build_connector_worker_meta",
        "save_kv_layer", "shutdown",
    ]


# ---------------------------------------------------------------- seeded faults


def _raised(vllm_config_with: Callable, seed: int, calls: int, log: str) -> list[bool]:
    from kvcompose.faults import InjectedFault

    worker = _build(vllm_config_with, "WORKER", {"seed": seed, "inner": _recording_inner(log),
                                                 "faults": {"raise": {"wait_for_save": 0.3}}})
    outcomes = []
    for _ in range(calls):
        try:
            worker.wait_for_save()
            outcomes.append(False)
        except InjectedFault:
            outcomes.append(True)
    return outcomes


def test_raise_rate_follows_the_probability_and_the_seed(vllm_config_with: Callable) -> None:
    first = _raised(vllm_config_with, seed=7, calls=1000, log="rate/a")
    again = _raised(vllm_config_with, seed=7, calls=1000, log="rate/b")
    other = _raised(vllm_config_with, seed=8, calls=1000, log="rate/c")
    assert 250 <= sum(first) <= 350
    assert first == again  # a second instance (another process) decides alike
    assert first != other and 250 <= sum(other) <= 350
    # Raised calls never reached the inner connector.
    assert len(recording.CALL_LOGS["rate/a"]) == 1000 - sum(first)


def test_latency_is_added_before_the_call(vllm_config_with: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    slow = _build(vllm_config_with, "WORKER", {"inner": _recording_inner("slow"), "faults": {
        "latency": {"wait_for_save": {"probability": 1.0, "seconds": 0.05}}}})
    never = _build(vllm_config_with, "WORKER", {"inner": _recording_inner("never"), "faults": {
        "latency": {"wait_for_save": {"probability": 0.0, "seconds": 5.0}}}})
    slept: list[tuple[float, int]] = []  # this thread's sleeps: seconds, and the calls the inner ones had by then
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread() is threading.main_thread():
            slept.append((seconds, sum(len(recording.CALL_LOGS.get(log, ())) for log in ("slow", "never"))))
        else:
            real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    for connector in (slow, never):
        for _ in range(4):
            connector.wait_for_save()
    assert slept == [(0.05, calls) for calls in range(4)]  # each slow call slept first; no never call slept
    assert len(recording.CALL_LOGS["slow"]) == len(recording.CALL_LOGS["never"]) == 4


# ---------------------------------------------------------------- lies


def _lying_pair(vllm_config_with: Callable, log: str, script: dict[str, Any], lie: float = 1.0) -> tuple[Any, Any]:
    settings = {"seed": 3, "inner": _recording_inner(log, script), "faults": {"lie": lie}}
    return _build(vllm_config_with, "SCHEDULER", settings), _build(vllm_config_with, "WORKER", settings)


@pytest.mark.parametrize(
    ("hit_blocks", "computed_blocks", "unloaded"),
    [
        (3, 0, [10, 11, 12]),
        (2, 1, [11, 12]),  # the first block is computed locally
        (1.25, 0, [10, 11]),  # a hit ending inside a block fails that block too
    ],
)
def test_a_lie_reports_the_hit_and_the_worker_reports_its_blocks_unloaded(
    vllm_config_with: Callable, base_vllm_config: Any, hit_blocks: float, computed_blocks: int, unloaded: list[int]
) -> None:
    from vllm.v1.core.sched.output import SchedulerOutput

    block_size = base_vllm_config.cache_config.block_size
    inner_match, computed = int(hit_blocks * block_size), computed_blocks * block_size
    log = f"lie/{hit_blocks}/{computed_blocks}"
    scheduler, worker = _lying_pair(vllm_config_with, log, {"matches": {"r1": [[inner_match, False]]}})
    request = _request("r1")

    assert scheduler.get_num_new_matched_tokens(request, computed) == (inner_match, False)
    scheduler.update_state_after_alloc(request, _blocks(10, 11, 12, 13), inner_match)
    metadata = scheduler.build_connector_meta(SchedulerOutput.make_empty())
    assert list(metadata.unloaded_block_ids) == unloaded
    # The inner connector is never asked to load: it hears 0 external tokens.
    assert ("update_state_after_alloc", "r1", (10, 11, 12, 13), 0) in recording.CALL_LOGS[log]

    worker.bind_connector_metadata(metadata)
    assert worker.get_block_ids_with_load_errors() == set(unloaded)
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    worker.clear_connector_metadata()
    assert scheduler.build_connector_meta(SchedulerOutput.make_empty()).unloaded_block_ids == ()


def test_no_lie_without_a_synchronous_hit_or_when_another_child_loads(vllm_config_with: Callable) -> None:
    from vllm.v1.core.sched.output import SchedulerOutput

    script = {"matches": {"later": [[None, False]], "async": [[16, True]], "miss": [[0, False]],
                          "other": [[32, False]]}}
    log = "no-lie"
    scheduler, _ = _lying_pair(vllm_config_with, log, script)
    for request_id, answer in (("later", (None, False)), ("async", (16, True)), ("miss", (0, False))):
        request = _request(request_id)
        assert scheduler.get_num_new_matched_tokens(request, 0) == answer
        scheduler.update_state_after_alloc(request, _blocks(1, 2, 3, 4), answer[0] or 0)
    # A lie the composite did not act on: it chose another child, so 0 external tokens here.
    other = _request("other")
    assert scheduler.get_num_new_matched_tokens(other, 0) == (32, False)
    scheduler.update_state_after_alloc(other, _blocks(1, 2, 3, 4), 0)
    assert scheduler.build_connector_meta(SchedulerOutput.make_empty()).unloaded_block_ids == ()
    told = [entry[2:] for entry in recording.CALL_LOGS[log] if entry[0] == "update_state_after_alloc"]
    assert told == [((1, 2, 3, 4), 0), ((1, 2, 3, 4), 16), ((1, 2, 3, 4), 0), ((1, 2, 3, 4), 0)]


def test_lies_are_seeded_per_request(vllm_config_with: Callable) -> None:
    from vllm.v1.core.sched.output import SchedulerOutput

    ids = [f"req-{i}" for i in range(200)]

    def liars(seed: int, order: list[str]) -> set[int]:
        script = {"matches": {rid: [[16, False]] for rid in ids}}
        settings = {"seed": seed, "inner": _recording_inner(f"liars/{seed}", script), "faults": {"lie": 0.5}}
        scheduler = _build(vllm_config_with, "SCHEDULER", settings)
        for rid in order:
            request = _request(rid)
            scheduler.get_num_new_matched_tokens(request, 0)
            scheduler.update_state_after_alloc(request, _blocks(ids.index(rid)), 16)
        return set(scheduler.build_connector_meta(SchedulerOutput.make_empty()).unloaded_block_ids)

    first = liars(11, ids)
    assert 70 <= len(first) <= 130
    assert liars(11, ids[::-1]) == first  # the order of requests does not matter, only the seed and the id
    assert liars(12, ids) != first


def test_through_the_composite_lies_count_as_load_errors_and_faults_by_type(
    vllm_config_with: Callable, base_vllm_config: Any
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvcompose.connectors import KVComposeConnector
    from kvcompose.faults import InjectedFault

    hit = 3 * base_vllm_config.cache_config.block_size
    pipeline = {"version": 1, "name": "staging", "children": [
        {"name": "flaky", **FAULT_INJECTION, "config": {
            "inner": _recording_inner("composite/flaky", {"matches": {"r1": [[hit, False]]}}),
            "faults": {"lie": 1.0, "raise": {"start_load_kv": 1.0}}}},
        {"name": "steady", **RECORDING, "config": {"log": "composite/steady"}},
    ]}
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}})
    scheduler = KVComposeConnector(config, KVConnectorRole.SCHEDULER, None)
    worker = KVComposeConnector(config, KVConnectorRole.WORKER, None)

    request = _request("r1")
    assert scheduler.get_num_new_matched_tokens(request, 0) == (hit, False)
    scheduler.update_state_after_alloc(request, _blocks(5, 6, 7, 8), hit)
    worker.bind_connector_metadata(scheduler.build_connector_meta(SchedulerOutput.make_empty()))
    # Whether the fault reaches vLLM is the child's on_error setting; either way it is counted.
    with contextlib.suppress(InjectedFault):
        worker.start_load_kv(None)
    assert worker.get_block_ids_with_load_errors() == {5, 6, 7}

    calls = worker.get_kv_connector_stats().calls
    assert calls.errors["flaky"] == {"start_load_kv": {"InjectedFault": 1}}
    assert calls.load_error_blocks("flaky") == 3


# ---------------------------------------------------------------- no state outlives its request


# Every operation a request's life calls on a child (below, through the composite).
LIFECYCLE_OPERATIONS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
    "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
    "get_transfer_results", "get_block_ids_with_load_errors", "clear_connector_metadata",
)


def _live_through_the_composite(scheduler: Any, worker: Any, request_ids: list[str], hit: int) -> None:
    """vLLM's calls for each request, one request per step: lookup, allocation, the step's metadata, the
    worker's step, finish. Every third request is aborted while waiting: finished after its lookup."""
    from kvcompose.testing.steps import forward_step

    from .connector_support import make_blocks, make_request, scheduler_output

    for index, request_id in enumerate(request_ids):
        request = make_request(request_id)
        matched, _ = scheduler.get_num_new_matched_tokens(request, 0)
        if index % 3 == 2:
            scheduler.request_finished(request, [])
            continue
        blocks = make_blocks(4 * index, 4 * index + 1, 4 * index + 2, 4 * index + 3)
        scheduler.update_state_after_alloc(request, blocks, matched or 0)
        worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output(new=[request])))
        forward_step(worker, finished=[request_ids[index - 1]] if index else ())
        worker.clear_connector_metadata()
        scheduler.request_finished(request, list(blocks.get_block_ids()[0]))


@pytest.mark.parametrize("failing", [*LIFECYCLE_OPERATIONS, "all"])
def test_a_fault_in_any_operation_leaves_no_state_behind(
    vllm_config_with: Callable, base_vllm_config: Any, failing: str
) -> None:
    """Every request hits and is lied about; the failing operation(s) raise. Afterwards neither the
    injector nor the composite holds anything for a request or a step."""
    from .connector_support import composite_pair

    request_ids = [f"{failing}-{i}" for i in range(300)]
    hit = 3 * base_vllm_config.cache_config.block_size
    script = {"matches": {request_id: [[hit, False]] for request_id in request_ids}}
    raises = {op: 0.5 for op in LIFECYCLE_OPERATIONS} if failing == "all" else {failing: 1.0}
    pipeline = {"version": 1, "name": "leak", "children": [
        {"name": "flaky", **FAULT_INJECTION, "circuit_breaker": {"enabled": False}, "config": {
            "seed": 2, "inner": _recording_inner(f"leak/{failing}", script),
            "faults": {"lie": 1.0 if failing != "all" else 0.5, "raise": raises}}},
        {"name": "steady", **RECORDING, "config": {"log": f"leak/{failing}/steady"}},
    ]}
    scheduler, worker = composite_pair(vllm_config_with, pipeline)
    _live_through_the_composite(scheduler, worker, request_ids, hit)

    injectors = [scheduler.children[0].connector, worker.children[0].connector]
    assert sum(injector.plan.injected[op] for injector in injectors for op in raises) > 0  # the faults fired
    assert [injector.request_state_sizes() for injector in injectors] == [{}, {}]
    assert scheduler.request_state_sizes() == {} and worker.request_state_sizes() == {}
    recording.CALL_LOGS.pop(f"leak/{failing}/steady", None)


# ---------------------------------------------------------------- faults that change at run time


def _write(path: Path, text: str) -> None:
    """Replace the file whole, as the faults_file documentation asks."""
    staging = path.with_suffix(".new")
    staging.write_text(text)
    staging.replace(path)


def test_a_faults_file_changes_the_faults_of_a_running_connector(
    vllm_config_with: Callable, tmp_path: Path
) -> None:
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvcompose.faults import InjectedFault

    faults_file = tmp_path / "faults.yaml"
    settings = {"inner": _recording_inner("file"), "faults_file": str(faults_file)}
    scheduler, worker = (_build(vllm_config_with, role, settings) for role in ("SCHEDULER", "WORKER"))

    def next_step_raises() -> bool:
        worker.bind_connector_metadata(scheduler.build_connector_meta(SchedulerOutput.make_empty()))
        try:
            worker.wait_for_save()
            return False
        except InjectedFault:
            return True
        finally:
            worker.clear_connector_metadata()

    assert not next_step_raises()  # no file yet: no faults
    _write(faults_file, "raise: {wait_for_save: 1.0}\n")
    assert next_step_raises() and next_step_raises()
    log = logging.handlers.BufferingHandler(capacity=100)
    logging.getLogger("kvcompose.fault_injection").addHandler(log)
    try:
        _write(faults_file, "raise: {wait_for_sav: 1.0}\n")  # a typo: the faults stay as they were
        assert next_step_raises()
    finally:
        logging.getLogger("kvcompose.fault_injection").removeHandler(log)
    refused = [line for record in log.buffer if "faults file not applied" in (line := record.getMessage())]
    assert len(refused) == 2  # once by each side, each reading the file once
    typo = ":1: raise: unknown operation 'wait_for_sav'; did you mean 'wait_for_save'?"  # the file's line 1
    assert all(typo in line for line in refused)
    _write(faults_file, "raise: {}\nraise: {}\n")  # a duplicate key: refused too
    assert next_step_raises()
    _write(faults_file, "")  # empty: no faults
    assert not next_step_raises()
    _write(faults_file, "raise: {wait_for_save: 1.0}\n")
    assert next_step_raises()
    faults_file.unlink()  # gone: no faults
    assert not next_step_raises()


def test_faults_and_faults_file_are_exclusive() -> None:
    path, message = _problem({"inner": INNER, "faults": {"lie": 0.1}, "faults_file": "/tmp/f.yaml"})
    assert path == () and message == "set faults or faults_file, not both"


# ---------------------------------------------------------------- stats and metrics of the inner connector


def test_inner_stats_and_metrics_survive_the_wrapper(vllm_config_with: Callable) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    from kvcompose.connectors import FaultInjectionConnector, KVComposeConnector
    from kvcompose.connectors.fault_injection import InnerConnectorStats
    from kvcompose.wire.native import NativeStats, class_path

    def inner_stats(load_bytes: int) -> InnerConnectorStats:
        stats = OffloadingConnectorStats()
        stats.increase_counter("vllm:kv_offload_load_bytes", load_bytes)
        return InnerConnectorStats(NativeStats(class_path(OffloadingConnector), stats))

    # As vLLM's own connector: the front-end rebuilds the payload from the class alone.
    rebuilt = FaultInjectionConnector.build_kv_connector_stats(inner_stats(10).to_dict())
    merged = rebuilt.aggregate(inner_stats(5))
    assert merged.reduce() == OffloadingConnector.build_kv_connector_stats(
        data=inner_stats(15).native.stats.to_dict()).reduce()
    assert not merged.is_empty()

    # As a pipeline child: the inner connector's native series carry the child's name.
    registry = CollectorRegistry()
    metric_types: dict[type, Any] = {
        kind: type(f"Isolated{kind.__name__}", (kind,), {
            "__init__": lambda self, *a, _kind=kind, **k: _kind.__init__(self, *a, registry=registry, **k)})
        for kind in (Counter, Gauge, Histogram)
    }
    pipeline = {"version": 1, "name": "p", "children": [
        {"name": "flaky", **FAULT_INJECTION, "config": {"inner": {"connector": "OffloadingConnector"}}},
    ]}
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}})
    prom = KVComposeConnector.build_prom_metrics(config, metric_types, ["model_name", "engine"], {0: ["m", "0"]})
    native = NativeStats(class_path(FaultInjectionConnector), inner_stats(1000))
    prom.observe({"native": {"flaky": native.to_dict()}}, 0)
    exposition = generate_latest(registry).decode()
    assert 'vllm:kv_offload_load_bytes_total{connector="flaky",engine="0",model_name="m"} 1000.0' in exposition


# ---------------------------------------------------------------- a real engine


class _VllmLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def in_process_engine(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Scheduler and worker in this process, so the test sees vLLM's scheduler log."""
    import vllm.envs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm.envs.disable_envs_cache()
    scheduler_log = _VllmLog()
    # Attached after `import vllm`: vLLM's logging set-up clears handlers of its loggers.
    logger = logging.getLogger("vllm.v1.core.sched.scheduler")
    logger.addHandler(scheduler_log)
    yield scheduler_log
    logger.removeHandler(scheduler_log)
    vllm.envs.disable_envs_cache()  # the in-process engine cached every VLLM_* variable


@pytest.mark.engine
def test_vllm_recomputes_the_blocks_a_lying_child_did_not_load(
    tiny_model: Path, plain_llm: Any, tmp_path: Path, in_process_engine: _VllmLog
) -> None:
    """Every hit is a lie. Under kv_load_failure_policy=recompute (vLLM's default
    is "fail") vLLM recomputes the reported blocks and generates exactly what an
    engine without a connector does, and the inner store is left as it was."""
    from kvcompose.config import load_pipeline
    from kvcompose.render import kv_transfer_config

    from .engine_support import generate, start_llm

    prompts = [prompt_words(seed=70 + i, length=96) for i in range(2)]
    expected = [tokens for tokens, _ in generate(plain_llm, prompts)]
    store = tmp_path / "store"
    pipeline = {"version": 1, "name": "rehearsal", "children": [
        {"name": "flaky", **FAULT_INJECTION, "config": {
            "seed": 1, "faults": {"lie": 1.0},
            "inner": {"connector": "ExampleConnector", "config": {"shared_storage_path": str(store)}}}},
    ]}
    config = kv_transfer_config(load_pipeline(pipeline), pipeline)
    assert config["kv_load_failure_policy"] == "recompute"  # load.on_failure's default; vLLM's own is "fail"
    llm = start_llm(tiny_model, config, disable_log_stats=False)
    try:
        # A cold store misses: nothing to lie about, the prompts are computed and saved.
        first = generate(llm, prompts)
        assert [tokens for tokens, _ in first] == expected and [cached for _, cached in first] == [0, 0]
        saved = {path: path.read_bytes() for path in store.rglob("*.safetensors")}
        assert saved
        assert not [m for m in in_process_engine.messages if "KV load failure" in m]

        # Now every lookup hits and lies: vLLM schedules the hit, gets its blocks back as
        # load errors, and recomputes them.
        second = generate(llm, prompts)
        assert [tokens for tokens, _ in second] == expected
        hit_tokens = sum(cached for _, cached in second)
        assert hit_tokens > 0  # vLLM still counts the claimed tokens as cached
        recovered = [m for m in in_process_engine.messages if "KV load failure" in m]
        assert recovered == [
            f"Recovered from KV load failure: 2 request(s) rescheduled ({hit_tokens} tokens affected)."
        ]
        # Counted against the lying child, a block per claimed block.
        from prometheus_client import generate_latest

        from kvcompose.metrics.summary import summarize

        block_size = llm.llm_engine.vllm_config.cache_config.block_size
        assert summarize(generate_latest().decode())["flaky"].load_error_blocks == hit_tokens // block_size
        # The inner connector loaded and saved nothing: its store is unchanged.
        assert {path: path.read_bytes() for path in store.rglob("*.safetensors")} == saved
    finally:
        llm.llm_engine.engine_core.shutdown()
