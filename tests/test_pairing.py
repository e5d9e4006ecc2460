"""A prefill/decode pair whose pipelines differ: kvcompose names the setting at fault."""

from __future__ import annotations

import copy
import os
import json
import logging
import logging.handlers
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcompose.config import load_pipeline
from kvcompose.connectors.pairing import PAIRING_KEY, PairingCheck, PipelineShape, entry_hash, mismatches
from kvcompose.log_throttle import LogThrottle
from kvcompose.logs import ROOT_LOGGER
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
        "malformed 'kvcompose' entry in kv_transfer_params: kvcompose.pipeline: missing"
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


# ---------------------------------------------------------------- entries from request bodies


@pytest.mark.parametrize(
    ("entry", "field", "fault"),
    [
        ([1, 2], "kvcompose", "not a mapping (an array)"),
        ({"pipeline": "p", "hybrid_kv_cache_manager": False}, "kvcompose.children", "missing"),
        ({"pipeline": "Bad Name", "hybrid_kv_cache_manager": False, "children": []}, "kvcompose.pipeline",
         "not a label-safe pipeline name"),
        ({"pipeline": "p", "hybrid_kv_cache_manager": "yes", "children": []}, "kvcompose.hybrid_kv_cache_manager",
         "not a boolean (a string)"),
        ({"pipeline": "p", "hybrid_kv_cache_manager": False, "children": []}, "kvcompose.children",
         "not a list of 1 to 64 children"),
        ({"pipeline": "p", "hybrid_kv_cache_manager": False, "children": [["a", "B"]]}, "kvcompose.children[0]",
         "not [name, connector, class] strings"),
        ({"pipeline": "p", "hybrid_kv_cache_manager": False, "children": [["a", "B", "C"], ["b\n", "B", "C"]]},
         "kvcompose.children[1][0]", "not a label-safe child name"),
        ({"pipeline": "p", "hybrid_kv_cache_manager": False, "children": [["a", "B()", "C"]]},
         "kvcompose.children[0]", "connector or class is not a class name"),
    ],
)
def test_a_malformed_entry_names_the_field_and_quotes_nothing(
    prefill_shape: PipelineShape, entry: Any, field: str, fault: str
) -> None:
    [problem] = PairingCheck(prefill_shape).problems({**HANDOFF, PAIRING_KEY: entry})
    assert problem == f"malformed 'kvcompose' entry in kv_transfer_params: {field}: {fault}"


class _Rendered(logging.Handler):
    """The kvcompose log output exactly as its stream handler writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))
        self.text = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.text += self.format(record) + "\n"


@pytest.fixture
def rendered() -> Any:
    handler = _Rendered()
    logging.getLogger(ROOT_LOGGER).addHandler(handler)
    yield handler
    logging.getLogger(ROOT_LOGGER).removeHandler(handler)


FORGED = "ok\n2026-01-01T00:00:00Z [info     ] all good\x1b[2J\r\u2028"


@pytest.mark.parametrize(
    "entry",
    [
        {"pipeline": FORGED, "hybrid_kv_cache_manager": False, "children": [["hot", "ExampleConnector"] * 2]},
        {"pipeline": "pd-prefill", "hybrid_kv_cache_manager": False,
         "children": [["nixl", "NixlConnector", "NixlPullConnector"], [FORGED, "ExampleConnector", "X"]]},
        {"pipeline": "pd-prefill", "hybrid_kv_cache_manager": False,
         "children": [["nixl", f"Nixl{FORGED}", "NixlPullConnector"]]},
        {FORGED: FORGED},
        FORGED,
    ],
)
def test_a_forged_entry_cannot_write_a_log_line_of_its_own(
    prefill_shape: PipelineShape, rendered: _Rendered, entry: Any
) -> None:
    params = {**HANDOFF, PAIRING_KEY: entry}
    PairingCheck(prefill_shape).check(params)
    [line] = rendered.text.splitlines()  # str.splitlines also splits at \r and \u2028
    assert "prefill/decode pipelines do not match" in line and "malformed 'kvcompose' entry" in line
    assert "\x1b" not in line and "all good" not in line
    assert f"entry_sha256={entry_hash(entry)}" in line  # the entry can be found, not read, from the log


def test_five_thousand_distinct_entries_keep_a_fixed_memory(prefill_shape: PipelineShape) -> None:
    """Each entry a client sends is a new problem (a child name the pipeline lacks) or
    a malformed one; what the check remembers stays within its fixed number of digests."""
    import gc
    import tracemalloc

    check = PairingCheck(prefill_shape, LogThrottle(remembered=256, lines=10**9))
    logging.getLogger("kvcompose.pairing").disabled = True  # 10,000 lines to stderr prove nothing here

    def send(entries: range) -> None:
        for index in entries:
            children = [["nixl", "NixlConnector", "NixlPullConnector"], [f"c{index}", "ExampleConnector", "Ex"]]
            check.check({**HANDOFF, PAIRING_KEY: {"pipeline": "pd-prefill", "hybrid_kv_cache_manager": False,
                                                  "children": children}})
            check.check({**HANDOFF, PAIRING_KEY: {"payload": "x" * 500 + str(index)}})

    try:
        tracemalloc.start(8)  # deep enough to see the check below the allocations it makes
        send(range(1_000))  # fills the remembered digests, and the interpreter's caches the first calls make
        gc.collect()  # what is held, not what a reference cycle keeps until the collector runs
        before = tracemalloc.take_snapshot()
        send(range(1_000, 6_000))
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
    finally:
        logging.getLogger("kvcompose.pairing").disabled = False
    assert check.throttle.remembered == 256
    # Only what the check allocated (other tests' threads may allocate meanwhile).
    made_by_the_check = [tracemalloc.Filter(True, f"*{os.sep}kvcompose{os.sep}{name}", all_frames=True)
                         for name in (f"connectors{os.sep}pairing.py", "log_throttle.py")]
    kept = sum(stat.size_diff for stat in after.filter_traces(made_by_the_check).compare_to(
        before.filter_traces(made_by_the_check), "filename"))
    assert kept < 10_000, f"the pairing check kept {kept} more bytes after 10,000 more entries"  # a byte each: 10 kB


def test_repeated_problems_log_at_most_n_lines_per_interval(
    prefill_shape: PipelineShape, rendered: _Rendered
) -> None:
    now = [0.0]
    check = PairingCheck(prefill_shape, LogThrottle(lines=3, interval_s=60.0, clock=lambda: now[0]))

    def send(names: range) -> list[str]:
        start = len(rendered.text.splitlines())
        for index in names:  # one problem each: the hybrid KV cache manager, named with the remote pipeline
            remote = {**prefill_shape.to_params(), "pipeline": f"p{index}", "hybrid_kv_cache_manager": True}
            check.check({**HANDOFF, PAIRING_KEY: remote})
        return rendered.text.splitlines()[start:]

    assert len(send(range(50))) == 3
    now[0] = 59.0
    assert send(range(50, 60)) == []
    now[0] = 61.0
    lines = send(range(60, 70))
    assert len(lines) == 3 and "suppressed=57" in lines[0]
    # A problem already logged is not logged again, whatever the rate allows.
    now[0] = 200.0
    assert send(range(60, 61)) == []


def _nested(depth: int, make: Callable[[Any], Any]) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = make(value)
    return value


@pytest.mark.parametrize("make", [lambda inner: {"x": inner}, lambda inner: [inner]], ids=["objects", "arrays"])
def test_an_entry_nested_thousands_deep_is_logged_with_its_hash_not_a_recursion_error(
    prefill_shape: PipelineShape, rendered: _Rendered, make: Callable[[Any], Any],
) -> None:
    """kv_transfer_params come from request bodies: JSON nested past Python's recursion limit (1000) must not
    raise from the pairing check (json.dumps did). vLLM itself refuses such a request (see docs/failures.md)."""
    deep, deeper = _nested(5000, make), _nested(5001, make)
    check = PairingCheck(prefill_shape)
    check.check({**HANDOFF, PAIRING_KEY: deep})
    check.check({**HANDOFF, PAIRING_KEY: {"pipeline": "p", "hybrid_kv_cache_manager": False, "children": deep}})
    lines = rendered.text.splitlines()
    assert len(lines) == 2 and all("malformed 'kvcompose' entry" in line for line in lines)
    assert f"entry_sha256={entry_hash(deep)}" in lines[0]
    assert entry_hash(deep) == entry_hash(_nested(5000, make)) != entry_hash(deeper)


def test_a_composite_checks_deeply_nested_params_of_a_request_without_recursion(
    vllm_config_with: Callable, tmp_path: Path,
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvcompose.connectors import KVComposeConnector

    pipeline = {"version": 1, "name": "decode", "children": [
        {"name": "store", "connector": "ExampleConnector", "config": {"shared_storage_path": str(tmp_path)}}]}
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}})
    composite = KVComposeConnector(config, KVConnectorRole.SCHEDULER, None)
    params = {**HANDOFF, PAIRING_KEY: _nested(3000, lambda inner: {"x": inner})}
    request = Request("deep", list(range(1, 200)), SamplingParams(max_tokens=1, extra_args={
        "kv_transfer_params": params}), None)
    assert composite.get_num_new_matched_tokens(request, 0) == (0, False)
