"""A prefill/decode pair whose pipelines differ: kvcompose names the setting at fault."""

from __future__ import annotations

import copy
import json
import logging
import logging.handlers
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcompose.config import load_pipeline
from kvcompose.connectors.pairing import PAIRING_KEY, PairingCheck, PipelineShape, mismatches
from kvcompose.testing import recording

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "disaggregated"
HANDOFF = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0", "remote_block_ids": [[1]]}


def _shape(vllm_config_with: Callable, pipeline: dict[str, Any] | Path, hma: bool = False) -> PipelineShape:
    from kvcompose.connectors.children import child_specs

    loaded = load_pipeline(pipeline)
    config = vllm_config_with({"kv_connector": "ExampleConnector", "kv_role": "kv_both"})
    return PipelineShape.of(loaded.name, child_specs(config, loaded), hma)


def _decode_pipeline(**child_overrides: dict[str, Any]) -> dict[str, Any]:
    """examples/disaggregated/decode.yaml as a mapping, with children changed by name."""
    import yaml

    pipeline = yaml.safe_load((EXAMPLES / "decode.yaml").read_text())
    pipeline["children"] = [
        {**child, **child_overrides[child["name"]]} if child["name"] in child_overrides else child
        for child in pipeline["children"]
        if child_overrides.get(child["name"]) != {}
    ]
    return pipeline


@pytest.fixture(scope="module")
def prefill_shape(vllm_config_with: Callable) -> PipelineShape:
    return _shape(vllm_config_with, EXAMPLES / "prefill.yaml")


def test_the_shipped_pair_matches(vllm_config_with: Callable, prefill_shape: PipelineShape) -> None:
    decode = _shape(vllm_config_with, EXAMPLES / "decode.yaml")
    assert decode.children == prefill_shape.children
    assert mismatches(decode, prefill_shape) == []


def test_a_different_connector_names_the_child_and_both_classes(
    vllm_config_with: Callable, prefill_shape: PipelineShape
) -> None:
    decode = _shape(vllm_config_with, _decode_pipeline(nixl={"connector": "NixlPushConnector"}))
    [problem] = mismatches(decode, prefill_shape)
    assert problem.startswith("children[0].connector: child 'nixl' is 'NixlPushConnector'")
    assert "'NixlConnector' (class NixlPullConnector) in pipeline 'pd-prefill'" in problem


def test_the_hybrid_kv_cache_manager_names_the_composite_class(
    vllm_config_with: Callable, prefill_shape: PipelineShape
) -> None:
    decode = _shape(vllm_config_with, EXAMPLES / "decode.yaml", hma=True)
    [problem] = mismatches(decode, prefill_shape)
    assert "hybrid KV cache manager is on for pipeline 'pd-decode' and off for pipeline 'pd-prefill'" in problem
    assert "KVComposeHMAConnector" in problem


def test_missing_and_extra_children_are_named(vllm_config_with: Callable, prefill_shape: PipelineShape) -> None:
    decode = _shape(vllm_config_with, _decode_pipeline(store={}))
    assert mismatches(decode, prefill_shape) == [
        "children: pipeline 'pd-prefill' of the server that prefilled this request has child 'store' "
        "(ExampleConnector), which pipeline 'pd-decode' lacks; both servers of a pair run the same children"
    ]
    [extra] = mismatches(prefill_shape, decode)
    assert extra.startswith("children[1].name: child 'store' (ExampleConnector) of pipeline 'pd-prefill'")


def test_stamp_survives_json_and_only_marks_handoffs(prefill_shape: PipelineShape) -> None:
    check = PairingCheck(prefill_shape)
    stamped = check.stamp(dict(HANDOFF))
    assert stamped is not None
    assert PipelineShape.from_params(json.loads(json.dumps(stamped))[PAIRING_KEY]) == prefill_shape
    assert check.stamp({"remote_host": "h"}) == {"remote_host": "h"}  # not a handoff: untouched
    assert check.stamp(None) is None
    with pytest.raises(RuntimeError, match="reserves"):
        check.stamp({**HANDOFF, PAIRING_KEY: {}})


def test_params_from_a_server_without_kvcompose(prefill_shape: PipelineShape) -> None:
    [problem] = PairingCheck(prefill_shape).problems(dict(HANDOFF))
    assert "runs no kvcompose pipeline (or the proxy dropped the key)" in problem
    assert "off for pipeline 'pd-prefill'" in problem
    assert PairingCheck(prefill_shape).problems({**HANDOFF, PAIRING_KEY: {"children": 3}}) == [
        "malformed 'kvcompose' entry in kv_transfer_params: {'children': 3}"
    ]
    assert PairingCheck(prefill_shape).problems({**HANDOFF, "do_remote_prefill": False}) == []


def test_composites_stamp_and_check_through_kv_transfer_params(
    vllm_config_with: Callable, tmp_path: Path
) -> None:
    """Two real KVComposeConnector schedulers: the prefill side's request_finished
    stamps the handoff, the decode side's lookup logs the mismatch once."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvcompose.connectors import KVComposeConnector

    def scheduler(name: str, second_connector: dict[str, Any]) -> Any:
        child = {"connector": "RecordingConnector", "module_path": "kvcompose.testing.recording"}
        script = {"params": {"r1": HANDOFF}}
        pipeline = {"version": 1, "name": name, "children": [
            {"name": "nixl", **child, "config": {"log": f"pairing/{name}", "script": script}},
            {"name": "store", **second_connector},
        ]}
        config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path":
                                   "kvcompose.connectors", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"pipeline": pipeline}})
        return KVComposeConnector(config, KVConnectorRole.SCHEDULER, None)

    prefill = scheduler("pd-prefill", {"connector": "ExampleConnector",
                                       "config": {"shared_storage_path": str(tmp_path)}})
    decode = scheduler("pd-decode", {"connector": "RecordingConnector", "module_path": "kvcompose.testing.recording",
                                     "config": {"log": "pairing/decode-store"}})
    _, params = prefill.request_finished(Request("r1", [1, 2, 3], SamplingParams(max_tokens=1), None), [1])
    assert params is not None and params[PAIRING_KEY]["pipeline"] == "pd-prefill"

    incoming = Request("r2", [1, 2, 3], SamplingParams(max_tokens=4, extra_args={
        "kv_transfer_params": copy.deepcopy(json.loads(json.dumps(params)))}), None)
    captured = logging.handlers.BufferingHandler(capacity=100)
    logging.getLogger("kvcompose.pairing").addHandler(captured)
    try:
        decode.get_num_new_matched_tokens(incoming, 0)
        decode.get_num_new_matched_tokens(incoming, 0)
    finally:
        logging.getLogger("kvcompose.pairing").removeHandler(captured)
    [record] = captured.buffer
    assert record.levelno == logging.ERROR
    line = record.getMessage()
    assert "prefill/decode pipelines do not match" in line and "pipeline=pd-decode" in line
    assert "children[1].connector: child 'store' is 'RecordingConnector'" in line
    assert "'ExampleConnector' (class ExampleConnector) in pipeline 'pd-prefill'" in line
    for log in ("pairing/pd-prefill", "pairing/pd-decode", "pairing/decode-store"):
        recording.CALL_LOGS.pop(log, None)
