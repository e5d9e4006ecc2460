"""What differs between vLLM 0.30 and 0.33, with real vLLM classes: sleep mode and children vLLM finds by name.

Sleep mode arrived in 0.33 (no CPU build): these tests call the hooks the way
vLLM 0.33 does (``supports_sleep_mode`` on the class with the composite's
KVTransferConfig; ``unregister_kv_caches``/``restore_kv_caches`` on the worker)
and run on every release, where they are harmless extras.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvcompose.testing import recording

from .connector_support import COMPOSITE, RECORDING

FAULT_INJECTION = {"connector": "FaultInjectionConnector", "module_path": "kvcompose.connectors"}


def _recording(name: str, log: str, **script: Any) -> dict[str, Any]:
    return {"name": name, **RECORDING, "config": {"log": log, "script": {"label": name, **script}}}


def _pipeline(*children: dict[str, Any]) -> dict[str, Any]:
    return {"version": 1, "name": "compat", "children": list(children)}


def _composite_transfer_config(pipeline: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**COMPOSITE, kv_connector_extra_config={"pipeline": pipeline})


def _supports_sleep_mode(*children: dict[str, Any]) -> bool:
    from kvcompose.connectors import KVComposeConnector

    return KVComposeConnector.supports_sleep_mode(_composite_transfer_config(_pipeline(*children)))


# ---------------------------------------------------------------- sleep mode


def test_sleep_mode_only_when_every_child_class_supports_it() -> None:
    # The child without "log" in its config cannot be constructed: the answer comes from the classes alone.
    unbuildable = {"name": "unbuildable", **RECORDING, "config": {"script": {"sleep_mode": True}}}
    assert _supports_sleep_mode(_recording("a", "sleep"), unbuildable) is True
    assert _supports_sleep_mode(_recording("a", "sleep"), _recording("b", "sleep", sleep_mode=False)) is False
    assert _supports_sleep_mode(_recording("a", "sleep", sleep_mode=False), _recording("b", "sleep")) is False


def test_a_child_class_from_before_sleep_mode_counts_as_supporting_it(tmp_path: Any) -> None:
    """ExampleConnector on 0.30-0.32 has no supports_sleep_mode; on 0.33 it inherits the base's True."""
    example = {"name": "disk", "connector": "ExampleConnector", "config": {"shared_storage_path": str(tmp_path)}}
    assert _supports_sleep_mode(example) is True
    assert _supports_sleep_mode(example, _recording("b", "sleep", sleep_mode=False)) is False


def test_fault_injection_answers_for_its_inner_connector_also_inside_a_pipeline() -> None:
    from vllm.config import KVTransferConfig

    from kvcompose.connectors import FaultInjectionConnector

    def injector(sleep_mode: bool) -> dict[str, Any]:
        return {"name": "flaky", **FAULT_INJECTION,
                "config": {"inner": {**RECORDING, "config": {"log": "x", "script": {"sleep_mode": sleep_mode}}}}}

    for sleep_mode in (True, False):
        own = KVTransferConfig(kv_connector="FaultInjectionConnector", kv_connector_module_path="kvcompose.connectors",
                               kv_role="kv_both", kv_connector_extra_config=injector(sleep_mode)["config"])
        assert FaultInjectionConnector.supports_sleep_mode(own) is sleep_mode
        assert _supports_sleep_mode(_recording("a", "sleep"), injector(sleep_mode)) is sleep_mode


@pytest.fixture
def sleeping_worker(vllm_config_with: Callable, tmp_path: Any) -> Callable[..., Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcompose.connectors import KVComposeConnector

    def build(log: str, *scripts: dict[str, Any]) -> Any:
        recording.CALL_LOGS[log].clear()
        children = [_recording(name, log, **script) for name, script in zip("abc", scripts, strict=False)]
        # A child whose class predates sleep mode (0.30-0.32) is passed over; on 0.33 its base does nothing.
        children.insert(1, {"name": "disk", "connector": "ExampleConnector",
                            "config": {"shared_storage_path": str(tmp_path)}})
        config = vllm_config_with({**COMPOSITE, "kv_connector_extra_config": {"pipeline": _pipeline(*children)}})
        return KVComposeConnector(config, KVConnectorRole.WORKER, None)

    return build


@pytest.mark.parametrize("operation", ["unregister_kv_caches", "restore_kv_caches"])
def test_sleep_calls_reach_every_child_in_order(sleeping_worker: Callable[..., Any], operation: str) -> None:
    worker = sleeping_worker(f"in-order/{operation}", {}, {}, {})
    getattr(worker, operation)()
    assert recording.CALL_LOGS[f"in-order/{operation}"] == [(operation, "a"), (operation, "b"), (operation, "c")]


@pytest.mark.parametrize("operation", ["unregister_kv_caches", "restore_kv_caches"])
def test_a_failing_child_does_not_stop_the_others_and_its_failure_is_raised(
    sleeping_worker: Callable[..., Any], operation: str
) -> None:
    log = f"failing/{operation}"
    worker = sleeping_worker(log, {"raises": [operation]}, {}, {})
    with pytest.raises(recording.ScriptedFailure, match=operation):
        getattr(worker, operation)()
    assert recording.CALL_LOGS[log] == [(operation, "a"), (operation, "b"), (operation, "c")]


def test_fault_injection_forwards_sleep_calls_and_can_fail_them(vllm_config_with: Callable) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcompose.connectors import FaultInjectionConnector
    from kvcompose.faults import InjectedFault

    def injector(log: str, faults: dict[str, Any]) -> Any:
        recording.CALL_LOGS[log].clear()
        inner = {**RECORDING, "config": {"log": log, "script": {"label": "inner"}}}
        config = vllm_config_with({"kv_connector": "FaultInjectionConnector",
                                   "kv_connector_module_path": "kvcompose.connectors", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"inner": inner, "faults": faults}})
        return FaultInjectionConnector(config, KVConnectorRole.WORKER, None)

    plain = injector("sleep/plain", {})
    plain.unregister_kv_caches()
    plain.restore_kv_caches()
    assert recording.CALL_LOGS["sleep/plain"] == [("unregister_kv_caches", "inner"), ("restore_kv_caches", "inner")]
    failing = injector("sleep/failing", {"raise": {"restore_kv_caches": 1.0}})
    with pytest.raises(InjectedFault):
        failing.restore_kv_caches()
    assert recording.CALL_LOGS["sleep/failing"] == []


# ---------------------------------------------------------------- children vLLM finds by name


def _connector_class(name: str) -> type:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector=name, kv_role="kv_both"))


@pytest.fixture
def sized_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33's behaviour (no CPU build to run it on): SimpleCPUOffloadConnector's pool is sized by name."""
    import kvcompose.compat

    monkeypatch.setattr(kvcompose.compat, "SIZED_BY_NAME", True)


def test_simple_cpu_offload_child_needs_num_cpu_blocks_where_vllm_sizes_it_by_name(sized_by_name: None) -> None:
    from kvcompose.compat import simple_cpu_offload_problem

    simple = _connector_class("SimpleCPUOffloadConnector")
    problem = simple_cpu_offload_problem(simple, {})
    assert problem is not None and "\n" not in problem
    assert "num_cpu_blocks" in problem and "OffloadingConnector" in problem
    assert simple_cpu_offload_problem(simple, {"num_cpu_blocks": 4096}) is None
    assert simple_cpu_offload_problem(type("MySimpleCPUOffload", (simple,), {}), {}) == problem
    assert simple_cpu_offload_problem(_connector_class("ExampleConnector"), {}) is None


def test_simple_cpu_offload_child_runs_where_vllm_does_not_size_it_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvcompose.compat

    monkeypatch.setattr(kvcompose.compat, "SIZED_BY_NAME", False)
    assert kvcompose.compat.simple_cpu_offload_problem(_connector_class("SimpleCPUOffloadConnector"), {}) is None


def test_the_composite_refuses_it_at_start_up_in_one_line_naming_the_child(
    sized_by_name: None, vllm_config_with: Callable, tmp_path: Any
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcompose.connectors import KVComposeConnector
    from kvcompose.connectors.children import ChildStartupError

    pipeline = _pipeline(_recording("a", "refused"), {"name": "cpu", "connector": "SimpleCPUOffloadConnector"})
    config = vllm_config_with({**COMPOSITE, "kv_connector_extra_config": {"pipeline": pipeline}})
    with pytest.raises(ChildStartupError) as raised:
        KVComposeConnector(config, KVConnectorRole.SCHEDULER, None)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("kvcompose: child 'cpu' (children[1], SimpleCPUOffloadConnector) failed to start")
    assert "config.num_cpu_blocks" in message


@pytest.fixture
def kvcompose_warnings() -> Iterator[list[str]]:
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("kvcompose").addHandler(handler)
    yield messages
    logging.getLogger("kvcompose").removeHandler(handler)


def test_a_child_vllm_looks_up_by_name_is_warned_about(kvcompose_warnings: list[str]) -> None:
    from kvcompose.compat import NAME_LOOKUPS, check_name_lookups
    from kvcompose.config import ChildConfig

    # vLLM's NixlConnector name resolves to its NixlPullConnector class: both names escape checks.
    check_name_lookups(ChildConfig(name="pd", connector="NixlConnector"), _connector_class("NixlConnector"))
    assert len(kvcompose_warnings) == 2
    for name in ("NixlConnector", "NixlPullConnector"):
        assert any(name in line and NAME_LOOKUPS[name] in line and "pd" in line for line in kvcompose_warnings)
    kvcompose_warnings.clear()
    check_name_lookups(ChildConfig(name="disk", connector="ExampleConnector"), _connector_class("ExampleConnector"))
    assert kvcompose_warnings == []
