"""KVComposeConnector against vLLM's own MultiConnector, call by call.

Each scenario drives a scheduler-side and a worker-side instance of both
connectors, over the same scripted RecordingConnector children, and asserts
identical return values and identical per-child call logs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from kvcompose.testing import recording
from kvcompose.testing.steps import forward_step

from .connector_support import RECORDING
from .connector_support import make_blocks as _blocks
from .connector_support import make_request as _request



@dataclass
class Side:
    scheduler: Any
    worker: Any


def _build(kind: str, scripts: dict[str, dict[str, Any]], vllm_config_with: Callable, policy: str,
           metrics: bool = True) -> Side:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvcompose.connectors import KVComposeConnector

    sides = {}
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        def extra(name: str) -> dict[str, Any]:
            key = f"{kind}/{role.name}/{name}"
            recording.CALL_LOGS.pop(key, None)
            return {"log": key, "script": scripts[name]}

        if kind == "multi":
            children = [
                {"kv_connector": RECORDING["connector"], "kv_connector_module_path": RECORDING["module_path"],
                 "kv_role": "kv_both", "kv_connector_extra_config": extra(name)}
                for name in scripts
            ]
            config = vllm_config_with(
                {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"connectors": children}}
            )
            sides[role] = MultiConnector(config, role, None)
        else:
            pipeline = {"version": 1, "name": "diff", "load": {"policy": policy}, "metrics": {"enabled": metrics},
                        "children": [{"name": name, **RECORDING, "config": extra(name)} for name in scripts]}
            config = vllm_config_with(
                {"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                 "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}}
            )
            sides[role] = KVComposeConnector(config, role, None)
    return Side(sides[KVConnectorRole.SCHEDULER], sides[KVConnectorRole.WORKER])


def _normalize(value: Any) -> Any:
    """Comparable form of a connector's return value (containers differ by class)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    if isinstance(value, KVConnectorTransferResults):
        return ("results", sorted(value.finished_sending), sorted(value.finished_recving), sorted(value.failed_recving))
    if isinstance(value, set | frozenset):
        return sorted(value)
    if hasattr(value, "per_child"):  # KVComposeWorkerMetadata
        return ("worker_meta", tuple(_normalize(m) for m in value.per_child))
    if type(value).__name__ == "MultiKVConnectorWorkerMetadata":
        return ("worker_meta", tuple(_normalize(m) for m in value.metadata))
    if isinstance(value, recording.RecordingWorkerMetadata):
        return ("count", value.count)
    if isinstance(value, contextlib.nullcontext):  # a recording child's memory pool
        return "mem_pool"
    if isinstance(value, tuple):
        return tuple(_normalize(v) for v in value)
    return value


def _run(scenario: Callable[[Side], list[Any]], side: Side) -> list[Any]:
    return [_normalize(v) for v in scenario(side)]


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as error:  # the scenario compares failures too
        return ("raised", type(error).__name__)


def _logs(kind: str, names: list[str]) -> dict[str, list[tuple[Any, ...]]]:
    return {
        f"{role}/{name}": recording.CALL_LOGS[f"{kind}/{role}/{name}"]
        for role in ("SCHEDULER", "WORKER")
        for name in names
    }


def assert_same_as_multiconnector(
    scripts: dict[str, dict[str, Any]], scenario: Callable[[Side], list[Any]], vllm_config_with: Callable
) -> list[Any]:
    """Both with metrics on and with metrics (and tracing) off: the composite's lookup differs between them."""
    multi = _run(scenario, _build("multi", scripts, vllm_config_with, "first_match"))
    for metrics in (True, False):
        compose = _run(scenario, _build("compose", scripts, vllm_config_with, "first_match", metrics))
        assert compose == multi, f"metrics {'on' if metrics else 'off'}"
        assert _logs("compose", list(scripts)) == _logs("multi", list(scripts)), f"metrics {'on' if metrics else 'off'}"
        assert any(_logs("compose", list(scripts)).values()), "scenario recorded no child call"
    return compose


def _step(side: Side, finished: set[str], layers: int = 2) -> list[Any]:
    """One engine step: metadata to the worker, layer loads and saves, results."""
    from vllm.v1.core.sched.output import SchedulerOutput

    out: list[Any] = []
    metadata = side.scheduler.build_connector_meta(SchedulerOutput.make_empty())
    side.worker.bind_connector_metadata(metadata)
    out += forward_step(side.worker, layers, finished)
    out.append(side.worker.build_connector_worker_meta())
    side.worker.clear_connector_metadata()
    return out


def test_first_match_loads_from_first_child_with_tokens(vllm_config_with: Callable) -> None:
    scripts = {
        "a": {"matches": {"r1": [[0, False]], "r2": [[0, False]]}},
        "b": {"matches": {"r1": [[16, False]], "r2": [[0, False]]}},
        "c": {"matches": {"r1": [[32, True]], "r2": [[0, False]]}},
    }

    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    def scenario(side: Side) -> list[Any]:
        r1, r2 = _request("r1"), _request("r2")
        out = [side.scheduler.get_num_new_matched_tokens(r1, 0), side.scheduler.get_num_new_matched_tokens(r2, 8)]
        side.scheduler.update_state_after_alloc(r1, _blocks(1, 2), 16)
        side.scheduler.update_state_after_alloc(r2, _blocks(3), 0)
        if hasattr(MultiConnector, "get_external_cache_hit_sources"):  # vLLM 0.32+ asks for it
            out.append(side.scheduler.get_external_cache_hit_sources(r1, 16))
        out += _step(side, set())
        out.append(side.scheduler.request_finished(r1, [1, 2]))
        out.append(side.scheduler.request_finished(r2, [3]))
        return out

    out = assert_same_as_multiconnector(scripts, scenario, vllm_config_with)
    assert out[0] == (16, False) and out[1] == (0, False)


def test_none_answer_means_still_looking(vllm_config_with: Callable) -> None:
    scripts = {
        "a": {"matches": {"r1": [[16, False]]}},
        "b": {"matches": {"r1": [[None, False], [0, False]]}},
        "c": {"matches": {"r1": [[32, False]]}},
    }

    def scenario(side: Side) -> list[Any]:
        r1 = _request("r1")
        out = [side.scheduler.get_num_new_matched_tokens(r1, 0), side.scheduler.get_num_new_matched_tokens(r1, 0)]
        side.scheduler.update_state_after_alloc(r1, _blocks(4, 5), out[-1][0])
        return out

    out = assert_same_as_multiconnector(scripts, scenario, vllm_config_with)
    assert out == [(None, False), (16, False)]


def test_a_lookup_that_misses_after_one_that_matched_loads_nothing(vllm_config_with: Callable) -> None:
    """The first lookup's loader is not the one of a later lookup that found no tokens."""
    scripts = {
        "a": {"matches": {"r1": [[16, True], [0, False]]}},
        "b": {"matches": {"r1": [[0, False]]}},
    }

    def scenario(side: Side) -> list[Any]:
        r1 = _request("r1")
        out = [side.scheduler.get_num_new_matched_tokens(r1, 0), side.scheduler.get_num_new_matched_tokens(r1, 0)]
        side.scheduler.update_state_after_alloc(r1, _blocks(1, 2), 0)
        out += _step(side, set())
        out.append(side.scheduler.request_finished(r1, [1, 2]))
        return out

    out = assert_same_as_multiconnector(scripts, scenario, vllm_config_with)
    assert out[:2] == [(16, True), (0, False)]


def test_a_lookup_round_lives_until_its_request_finishes(vllm_config_with: Callable) -> None:
    """MultiConnector keeps the index of a matched loader; kvcompose keeps the request's latest round (every
    loader's answer, for the load policy and the counts), the matched one replacing the miss, until vLLM finishes
    the request."""
    scripts = {"a": {"matches": {"r1": [[0, False], [16, False]]}}, "b": {"matches": {"r1": [[0, False]]}}}
    side = _build("compose", scripts, vllm_config_with, "first_match", metrics=False)
    r1 = _request("r1")
    assert side.scheduler.get_num_new_matched_tokens(r1, 0) == (0, False)
    assert side.scheduler.request_state_sizes() == {"lookup_rounds": 1}
    assert side.scheduler.get_num_new_matched_tokens(r1, 0) == (16, False)
    assert side.scheduler.request_state_sizes() == {"lookup_rounds": 1}
    side.scheduler.request_finished(r1, [])
    assert side.scheduler.request_state_sizes() == {}


def test_several_async_savers_finish_once(vllm_config_with: Callable) -> None:
    scripts = {
        "a": {"async_saves": ["r1", "r2"], "finished_sending": [["r1"], [], ["r2"]]},
        "b": {"async_saves": ["r1"], "finished_sending": [[], ["r1"]]},
        "c": {"async_saves": ["r1", "r2"], "finished_sending": [[], [], [], ["r1", "r2"]]},
    }

    def scenario(side: Side) -> list[Any]:
        r1, r2 = _request("r1"), _request("r2")
        out = [side.scheduler.get_num_new_matched_tokens(r, 0) for r in (r1, r2)]
        out += [side.scheduler.request_finished(r1, [1]), side.scheduler.request_finished(r2, [2])]
        for _ in range(5):
            out += _step(side, {"r1", "r2"}, layers=1)
        return out

    out = assert_same_as_multiconnector(scripts, scenario, vllm_config_with)
    sent = [v for v in out if isinstance(v, tuple) and v and v[0] == "results"]
    assert [s[1] for s in sent] == [[], [], [], ["r1", "r2"], []]


def test_transfer_results_load_errors_handshake_and_worker_meta(vllm_config_with: Callable) -> None:
    scripts = {
        "a": {"finished_recving": [["r1"]], "load_errors": [7, 9], "worker_meta": True},
        "b": {"failed_recving": [["r3"]], "finished_recving": [["r3"]], "load_errors": [9, 11], "handshake": "b"},
        "c": {"handshake": "c", "worker_meta": True},
    }

    def scenario(side: Side) -> list[Any]:
        from vllm.v1.outputs import KVConnectorOutput

        out = _step(side, {"r1"})
        out.append(side.worker.get_handshake_metadata().value)
        out.append(side.worker.get_finished(set()))
        side.worker.register_kv_caches({"layer.0": None, "layer.1": None})
        side.scheduler.set_xfer_handshake_metadata({0: None, 1: None})
        worker_meta = side.worker.build_connector_worker_meta()
        output = KVConnectorOutput(kv_connector_worker_meta=worker_meta)
        side.scheduler.update_connector_output(output)
        out.append(output.kv_connector_worker_meta is worker_meta)
        out.append(side.scheduler.has_pending_block_frees())
        out.append(list(side.scheduler.take_events()))
        return out

    out = assert_same_as_multiconnector(scripts, scenario, vllm_config_with)
    assert out[0] == ("results", [], ["r1", "r3"], ["r3"])
    assert out[1] == [7, 9, 11] and out[3] == "b" and out[4] == (None, None)


def test_kv_transfer_params_merge_and_key_clash(vllm_config_with: Callable) -> None:
    scripts = {
        "a": {"params": {"r1": {"remote_host": "h"}, "r2": {"x": 1}}},
        "b": {"params": {"r1": {"remote_port": 1}, "r2": {"x": 2}}},
    }

    def scenario(side: Side) -> list[Any]:
        return [
            side.scheduler.request_finished(_request("r1"), [1]),
            _call(side.scheduler.request_finished, _request("r2"), [2]),
        ]

    out = assert_same_as_multiconnector(scripts, scenario, vllm_config_with)
    assert out[0] == (False, {"remote_host": "h", "remote_port": 1})
    assert out[1] == ("raised", "RuntimeError")


def test_reset_cache_and_shutdown_reraise(vllm_config_with: Callable) -> None:
    scripts = {"a": {"reset_cache": False, "fail_shutdown": True}, "b": {"reset_cache": None}}

    def scenario(side: Side) -> list[Any]:
        return [side.scheduler.reset_cache(), _call(side.worker.shutdown)]

    out = assert_same_as_multiconnector(scripts, scenario, vllm_config_with)
    assert out == [False, ("raised", "RuntimeError")]


@pytest.mark.parametrize(("pools", "expected"), [
    ((False, False), None),
    ((False, True), "mem_pool"),  # the one child's pool
    ((True, True), ("raised", "ValueError")),  # the KV cache lives in one pool
])
def test_at_most_one_child_provides_the_memory_pool(
    vllm_config_with: Callable, pools: tuple[bool, bool], expected: Any,
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    if not hasattr(MultiConnector, "get_mem_pool_context"):
        pytest.skip("vLLM 0.30 has no get_mem_pool_context (0.31 added it): nothing asks")
    scripts = {name: {"mem_pool": pool} for name, pool in zip(("a", "b"), pools, strict=True)}

    def scenario(side: Side) -> list[Any]:
        return [_call(side.worker.get_mem_pool_context)]

    assert assert_same_as_multiconnector(scripts, scenario, vllm_config_with) == [expected]


def test_longest_match_prefers_more_tokens_ties_to_order(vllm_config_with: Callable) -> None:
    scripts = {
        "a": {"matches": {"r1": [[16, False]], "r2": [[32, False]]}},
        "b": {"matches": {"r1": [[48, True]], "r2": [[32, True]]}},
    }
    side = _build("compose", scripts, vllm_config_with, "longest_match")
    r1, r2 = _request("r1"), _request("r2")
    assert side.scheduler.get_num_new_matched_tokens(r1, 0) == (48, True)
    assert side.scheduler.get_num_new_matched_tokens(r2, 0) == (32, False)
    side.scheduler.update_state_after_alloc(r1, _blocks(1), 48)
    side.scheduler.update_state_after_alloc(r2, _blocks(2), 32)
    logs = _logs("compose", ["a", "b"])
    assert ("update_state_after_alloc", "r1", (1,), 48) in logs["SCHEDULER/b"]
    assert ("update_state_after_alloc", "r1", (1,), 0) in logs["SCHEDULER/a"]
    assert ("update_state_after_alloc", "r2", (2,), 32) in logs["SCHEDULER/a"]


def test_load_and_save_flags_limit_which_children_are_asked(vllm_config_with: Callable) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcompose.connectors import KVComposeConnector

    keys = {name: f"flags/{name}" for name in ("loader", "saver")}
    for key in keys.values():
        recording.CALL_LOGS.pop(key, None)
    pipeline = {
        "version": 1, "name": "flags",
        "children": [
            {"name": "loader", **RECORDING, "save": False,
             "config": {"log": keys["loader"], "script": {"matches": {"r1": [[16, False]]}}}},
            {"name": "saver", **RECORDING, "load": False,
             "config": {"log": keys["saver"], "script": {"matches": {"r1": [[64, False]]}}}},
        ],
    }
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}})
    scheduler = KVComposeConnector(config, KVConnectorRole.SCHEDULER, None)
    worker = KVComposeConnector(config, KVConnectorRole.WORKER, None)
    assert scheduler.get_num_new_matched_tokens(_request("r1"), 0) == (16, False)
    _step(Side(scheduler, worker), set())
    loader_ops = {entry[0] for entry in recording.CALL_LOGS[keys["loader"]]}
    saver_ops = {entry[0] for entry in recording.CALL_LOGS[keys["saver"]]}
    assert "save_kv_layer" not in loader_ops and "wait_for_save" not in loader_ops
    assert {"wait_for_layer_load", "start_load_kv"} <= loader_ops
    assert "get_num_new_matched_tokens" not in saver_ops and "wait_for_layer_load" not in saver_ops
    assert {"save_kv_layer", "wait_for_save", "build_connector_meta"} <= saver_ops


@pytest.mark.parametrize("bad", ["child_module", "child_class"])
def test_child_that_cannot_start_is_named(vllm_config_with: Callable, bad: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcompose.connectors import KVComposeConnector
    from kvcompose.connectors.children import ChildStartupError

    child = {"name": "broken", "connector": "RecordingConnector",
             "module_path": "no_such_module_kvc" if bad == "child_module" else "kvcompose.testing.recording",
             "config": {} if bad == "child_class" else {"log": "x"}}
    pipeline = {"version": 1, "name": "bad", "children": [child]}
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}})
    with pytest.raises(ChildStartupError, match=r"child 'broken' \(children\[0\], RecordingConnector"):
        KVComposeConnector(config, KVConnectorRole.SCHEDULER, None)


def test_a_child_keeping_the_base_classs_constant_answer_is_not_asked(
    vllm_config_with: Callable, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Operations whose KVConnectorBase_V1 implementation answers a constant (``skip_inherited``): the
    composite answers it without calling a child that inherits it, where MultiConnector calls every child
    (a call per child and step saved). The answers are the same."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvcompose.operations import OPERATIONS

    inherited = [name for name, operation in OPERATIONS.items() if operation.skip_inherited
                 and name not in vars(recording.RecordingConnector) and hasattr(KVConnectorBase_V1, name)]
    assert inherited, "the recording child overrides every such operation: nothing to check"
    asked: dict[str, int] = {}
    for name in inherited:  # the base's own answers, counted when a child is asked (children inherit the method)
        def base_answer(self: Any, *args: Any, _base: Callable[..., Any] = getattr(KVConnectorBase_V1, name),
                        _name: str = name) -> Any:
            if isinstance(self, recording.RecordingConnector):
                asked[_name] = asked.get(_name, 0) + 1
            return _base(self, *args)

        monkeypatch.setattr(KVConnectorBase_V1, name, base_answer)

    def scenario(side: Side) -> list[Any]:
        return [getattr(connector, name)() for name in inherited for connector in (side.scheduler, side.worker)
                if OPERATIONS[name].side.value in ("both", "scheduler" if connector is side.scheduler else "worker")]

    scripts: dict[str, dict[str, Any]] = {"hot": {}, "cold": {}}
    multi = _run(scenario, _build("multi", scripts, vllm_config_with, "first_match"))
    asked_by_multi, asked = asked, {}
    compose = _run(scenario, _build("compose", scripts, vllm_config_with, "first_match", metrics=False))
    assert compose == multi
    # Every release's MultiConnector asks each child for its stats on both sides (older ones forward fewer of
    # the others).
    assert asked_by_multi["get_kv_connector_stats"] == 2 * len(scripts)
    assert asked == {}


@pytest.mark.parametrize("role_name", ["SCHEDULER", "WORKER"])
def test_one_instance_asked_every_operation_of_both_roles_raises_only_where_multiconnector_does(
    vllm_config_with: Callable, exporter: Any, role_name: str,
) -> None:
    """vLLM's own MultiConnector tests ask one instance the operations of both roles (a worker-side connector's
    ``build_connector_worker_meta`` fed to its own ``update_connector_output``). The composite, metrics and every
    request traced at step granularity, must answer each where MultiConnector answers, whatever its role."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.v1.outputs import KVConnectorOutput

    from kvcompose.connectors import KVComposeConnector

    from .connector_support import COMPOSITE, scheduler_output

    role = KVConnectorRole[role_name]
    scripts = {"a": {"matches": {"r1": [[16, False]]}, "worker_meta": True, "finished_recving": [["r1"]]},
               "b": {"worker_meta": True, "handshake": "b"}}

    def child_config(kind: str, name: str) -> dict[str, Any]:
        key = f"both-roles/{kind}/{name}"
        recording.CALL_LOGS.pop(key, None)
        return {"log": key, "script": scripts[name]}

    multi = MultiConnector(vllm_config_with({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                                             "kv_connector_extra_config": {"connectors": [
                                                 {"kv_connector": RECORDING["connector"],
                                                  "kv_connector_module_path": RECORDING["module_path"],
                                                  "kv_role": "kv_both", "kv_connector_extra_config":
                                                      child_config("multi", name)} for name in scripts]}}),
                           role, None)
    pipeline = {"version": 1, "name": "both", "tracing": {"enabled": True, "sample_ratio": 1.0,
                                                          "granularity": "step"},
                "children": [{"name": name, **RECORDING, "config": child_config("kvcompose", name)}
                             for name in scripts]}
    composite = KVComposeConnector(vllm_config_with({**COMPOSITE, "kv_connector_extra_config": {"pipeline": pipeline}}),
                                   role, None)
    assert composite._instrumentation is not None and composite.pipeline.metrics.enabled

    def every_operation(connector: Any) -> list[Any]:
        request = _request("r1")
        outcomes: list[Any] = []

        def ask(name: str, *args: Any) -> None:
            try:
                answer = getattr(connector, name)(*args)
                outcomes.append((name, "answered", list(answer) if name == "take_events" else None))
            except Exception as error:
                outcomes.append((name, "raised", type(error).__name__))

        ask("get_num_new_matched_tokens", request, 0)
        ask("update_state_after_alloc", request, _blocks(1, 2), 16)
        metadata = connector.build_connector_meta(scheduler_output(new=[request], blocks=[1, 2]))
        ask("bind_connector_metadata", metadata)
        ask("start_load_kv", None)
        ask("wait_for_layer_load", "layer.0")
        ask("save_kv_layer", "layer.0", None, None)
        ask("wait_for_save")
        ask("get_finished", set())
        ask("get_block_ids_with_load_errors")
        worker_meta = connector.build_connector_worker_meta()
        ask("update_connector_output", KVConnectorOutput(kv_connector_worker_meta=worker_meta))
        ask("clear_connector_metadata")
        ask("get_handshake_metadata")
        ask("request_finished", request, [1, 2])
        ask("take_events")
        ask("get_kv_connector_stats")
        return outcomes

    expected = every_operation(multi)
    answered = every_operation(composite)
    assert [outcome[:2] for outcome in answered] == [outcome[:2] for outcome in expected]
    assert not [outcome for outcome in answered if outcome[1] == "raised"]
