"""Transfers tracked by the composite: spans with real start and end, outcomes, nothing left behind.

Driven step by step over scripted children, as vLLM orders the calls; the
real engines (OffloadingConnector, NIXL) are in the end-to-end tests.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from kvcompose.operations import OPERATIONS
from kvcompose.testing import recording
from kvcompose.testing.steps import forward_step
from kvcompose import names as attr

from .connector_support import RECORDING, composite_pair, make_blocks, make_request, scheduler_output

TRACEPARENT = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def _pair(
    vllm_config_with: Callable, scripts: dict[str, dict[str, Any]], kv_cache_config: Any = None, tracing: bool = True,
) -> tuple[Any, Any]:
    children = []
    for name, script in scripts.items():
        recording.CALL_LOGS.pop(f"transfers/{name}", None)
        children.append({"name": name, **RECORDING, "config": {"log": f"transfers/{name}", "script": script}})
    pipeline = {"version": 1, "name": "xfer", "tracing": {"enabled": tracing}, "children": children}
    return composite_pair(vllm_config_with, pipeline, kv_cache_config)


def _kv_cache() -> tuple[Any, int]:
    """A worker's KV cache of two layers, and the bytes of one block of it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    page = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["l0", "l1"], page)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups), 2 * page.page_size_bytes


def _step(scheduler: Any, worker: Any, new: list[Any] = (), finished: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output(new=new, blocks=[1, 2, 3])))
    forward_step(worker, finished=finished)
    worker.clear_connector_metadata()


def _finish(scheduler: Any, worker: Any, request: Any) -> None:
    """The request ends; the next step tells the workers, as vLLM does."""
    scheduler.request_finished(request, [1, 2, 3])
    _step(scheduler, worker, finished={request.request_id})


def _admit(scheduler: Any, request: Any) -> None:
    tokens, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(1, 2, 3), tokens or 0)


def _transfers(exporter: Any) -> list[ReadableSpan]:
    """The transfer spans, each named ``kvcompose.transfer <direction> <child>``."""
    spans = [span for span in exporter.get_finished_spans() if span.name.startswith("kvcompose.transfer ")]
    for span in spans:
        assert span.name == f"kvcompose.transfer {span.attributes[attr.TRANSFER_DIRECTION]} " \
                            f"{span.attributes[attr.CONNECTOR_NAME]}"
    return spans


def _described(span: ReadableSpan) -> tuple[str, str, str]:
    a = span.attributes
    return a[attr.CONNECTOR_NAME], a[attr.TRANSFER_DIRECTION], a[attr.TRANSFER_OUTCOME]


def test_sync_load_and_saves_are_transfers_in_the_requests_trace(vllm_config_with: Callable, exporter: Any) -> None:
    scheduler, worker = _pair(vllm_config_with, {"hot": {}, "cold": {"matches": {"r1": [[32, False]]}}})
    request = make_request("r1", TRACEPARENT)
    _admit(scheduler, request)
    _step(scheduler, worker, new=[request])
    _finish(scheduler, worker, request)

    spans = exporter.get_finished_spans()
    (request_span,) = [span for span in spans if span.name == "kvcompose.request"]
    transfers = _transfers(exporter)
    assert sorted(map(_described, transfers)) == [
        ("cold", "load", "ok"), ("cold", "save", "ok"), ("hot", "save", "ok")]
    for span in transfers:
        assert span.parent.span_id == request_span.context.span_id
        assert span.context.trace_id == request_span.context.trace_id
        assert span.end_time > span.start_time
        assert span.status.status_code is StatusCode.UNSET
    (load,) = [span for span in transfers if span.attributes[attr.TRANSFER_DIRECTION] == "load"]
    block_size = worker._vllm_config.cache_config.block_size
    assert load.attributes[attr.TRANSFER_BLOCKS] == -(-32 // block_size)  # the blocks 32 tokens fill
    assert {span.attributes[attr.TRANSFER_BLOCKS] for span in transfers if span != load} == {3}
    assert scheduler.request_state_sizes() == worker.request_state_sizes() == {}


def test_a_steps_sync_saves_are_each_a_transfer_with_its_savers_outcome(vllm_config_with: Callable,
                                                                       exporter: Any) -> None:
    """Three new requests saved by two sync savers in one step (each saver's saves are recorded at once), the
    hot one failing its wait_for_save: six transfers in the metrics and as spans."""
    scheduler, worker = _pair(vllm_config_with, {"hot": {"raises": ["wait_for_save"]}, "cold": {}})
    requests = [make_request(f"r{index}") for index in range(3)]
    for request in requests:
        _admit(scheduler, request)
    _step(scheduler, worker, new=requests)

    table = worker.get_kv_connector_stats().transfers
    assert table.transfers("hot", "save") == table.failed("hot", "save", "failed") == 3
    assert table.transfers("cold", "save") == 3
    assert table.failed("cold", "save", "failed") == table.failed("cold", "save", "aborted") == 0
    assert table.in_flight_change("hot", "save") == table.in_flight_change("cold", "save") == 0
    assert len(table.exemplars) == 2  # a traced save's trace, in each saver's bucket
    assert sorted(map(_described, _transfers(exporter))) == [("cold", "save", "ok")] * 3 + [
        ("hot", "save", "failed")] * 3
    assert {span.attributes[attr.REQUEST_ID] for span in _transfers(exporter)} == {"r0", "r1", "r2"}
    for request in requests:
        scheduler.request_finished(request, [1, 2, 3])
    _step(scheduler, worker, finished={request.request_id for request in requests})
    assert worker.request_state_sizes() == {}


def _two_loads_in_one_step(
    vllm_config_with: Callable, cold: dict[str, Any], tracing: bool,
) -> tuple[Any, int, int]:
    """r1 and r2 (256 tokens each) loaded by ``cold`` in their first step, saved by ``hot`` and ``cold``: the
    worker's transfer table, the bytes both loads move, and the bytes of one block."""
    kv_cache, block_bytes = _kv_cache()
    scheduler, worker = _pair(vllm_config_with, {"hot": {}, "cold": cold}, kv_cache, tracing=tracing)
    requests = [make_request("r1", TRACEPARENT), make_request("r2", TRACEPARENT)]
    for request, blocks in zip(requests, ((1, 2, 3), (4, 5, 6)), strict=True):
        tokens, _ = scheduler.get_num_new_matched_tokens(request, 0)
        scheduler.update_state_after_alloc(request, make_blocks(*blocks), tokens)
    _step(scheduler, worker, new=requests)
    loaded_blocks = 2 * -(-256 // worker._vllm_config.cache_config.block_size)
    return worker.get_kv_connector_stats().transfers, loaded_blocks * block_bytes, block_bytes


def test_a_steps_sync_loads_each_end_with_their_own_outcome_and_blocks(vllm_config_with: Callable,
                                                                       exporter: Any) -> None:
    """Two requests loaded by one child in one step (recorded at once, per outcome): the load whose block the
    child reports as a load error failed, the other did not; each moved its own blocks."""
    cold = {"matches": {"r1": [[256, False]], "r2": [[256, False]]}, "load_errors": [4]}  # two blocks each
    table, loaded_bytes, block_bytes = _two_loads_in_one_step(vllm_config_with, cold, tracing=True)

    assert table.transfers("cold", "load") == 2
    assert table.failed("cold", "load", "failed") == 1
    assert table.in_flight_change("cold", "load") == 0
    assert table.bytes_moved("cold", "load") == loaded_bytes
    assert table.bytes_moved("hot", "save") == 6 * block_bytes  # three blocks of each request
    loads = {span.attributes[attr.REQUEST_ID]: span for span in _transfers(exporter)
             if span.attributes[attr.TRANSFER_DIRECTION] == "load"}
    assert {req_id: span.attributes[attr.TRANSFER_OUTCOME] for req_id, span in loads.items()} == {
        "r1": "ok", "r2": "failed"}
    assert loads["r1"].attributes[attr.TRANSFER_BLOCKS] == loads["r2"].attributes[attr.TRANSFER_BLOCKS] == (
        loaded_bytes // block_bytes // 2)


def test_an_async_load_ends_when_its_child_reports_it(vllm_config_with: Callable, exporter: Any) -> None:
    cold = {"matches": {"r1": [[32, True]]}, "finished_recving": [[], ["r1"]]}
    scheduler, worker = _pair(vllm_config_with, {"hot": {}, "cold": cold})
    request = make_request("r1", TRACEPARENT)
    _admit(scheduler, request)
    _step(scheduler, worker, new=[request])
    assert not [span for span in _transfers(exporter) if span.attributes[attr.TRANSFER_DIRECTION] == "load"]
    time.sleep(0.02)  # the copy runs between the steps
    _step(scheduler, worker)
    _finish(scheduler, worker, request)

    (load,) = [span for span in _transfers(exporter) if span.attributes[attr.TRANSFER_DIRECTION] == "load"]
    assert _described(load) == ("cold", "load", "ok")
    assert load.end_time - load.start_time >= 20_000_000
    assert worker.request_state_sizes() == {}


def test_copied_bytes_are_the_bytes_of_the_transfers_with_a_copy_time(vllm_config_with: Callable) -> None:
    """An async load of a child that measures nothing has no copy time: its bytes count as moved, not as copied,
    so bytes copied over copy seconds (the throughput) holds the same transfers on both sides."""
    kv_cache, block_bytes = _kv_cache()
    cold = {"matches": {"r1": [[32, True]]}, "finished_recving": [[], ["r1"]]}
    scheduler, worker = _pair(vllm_config_with, {"hot": {}, "cold": cold}, kv_cache, tracing=False)
    request = make_request("r1")
    _admit(scheduler, request)
    _step(scheduler, worker, new=[request])
    table = worker.get_kv_connector_stats().transfers
    _step(scheduler, worker)
    table.add(worker.get_kv_connector_stats().transfers)

    load_blocks = -(-32 // worker._vllm_config.cache_config.block_size)
    assert table.transfers("cold", "load") == 1 and table.copy_seconds("cold", "load")[0] == 0
    assert (table.bytes_moved("cold", "load"), table.bytes_copied("cold", "load")) == (load_blocks * block_bytes, 0)
    for child in ("hot", "cold"):  # the sync saves: a copy time each, their bytes copied
        assert table.copy_seconds(child, "save")[0] == 1
        assert table.bytes_copied(child, "save") == table.bytes_moved(child, "save") == 3 * block_bytes


@pytest.mark.parametrize("cold_fails_in", ["wait_for_save", "start_load_kv"])
def test_with_tracing_off_a_steps_sync_loads_fail_only_when_they_did(vllm_config_with: Callable,
                                                                      cold_fails_in: str) -> None:
    """Both loads and all their blocks are recorded. A loader that fails in a save, after its loads, leaves
    them done (it fails its saves); one that fails loading has them given back to vLLM, and they failed."""
    cold = {"matches": {"r1": [[256, False]], "r2": [[256, False]]}, "raises": [cold_fails_in]}
    table, loaded_bytes, _ = _two_loads_in_one_step(vllm_config_with, cold, tracing=False)

    assert table.transfers("cold", "load") == 2
    assert table.failed("cold", "load", "failed") == (2 if cold_fails_in == "start_load_kv" else 0)
    assert table.bytes_moved("cold", "load") == loaded_bytes
    assert table.in_flight_change("cold", "load") == 0
    assert table.failed("cold", "save", "failed") == (2 if cold_fails_in == "wait_for_save" else 0)


def test_a_load_whose_request_vllm_finished_first_is_aborted(vllm_config_with: Callable, exporter: Any) -> None:
    cold = {"matches": {"r1": [[32, True]]}, "finished_recving": [[], ["r1"]]}
    scheduler, worker = _pair(vllm_config_with, {"hot": {}, "cold": cold})
    request = make_request("r1", TRACEPARENT)
    _admit(scheduler, request)
    _step(scheduler, worker, new=[request], finished={"r1"})  # aborted while loading
    _step(scheduler, worker)
    scheduler.request_finished(request, [1, 2, 3])

    (load,) = [span for span in _transfers(exporter) if span.attributes[attr.TRANSFER_DIRECTION] == "load"]
    assert _described(load) == ("cold", "load", "aborted")
    assert load.status.status_code is StatusCode.UNSET  # not the child's failure
    table = worker.get_kv_connector_stats().transfers
    assert (table.transfers("cold", "load"), table.failed("cold", "load", "aborted")) == (1, 1)
    assert table.in_flight_change("cold", "load") == 0  # started and ended since the last report


def test_a_failed_load_is_a_failed_transfer(vllm_config_with: Callable, exporter: Any) -> None:
    cold = {"matches": {"r1": [[32, False]]}, "raises": ["start_load_kv"]}
    scheduler, worker = _pair(vllm_config_with, {"hot": {}, "cold": cold})
    request = make_request("r1", TRACEPARENT)
    _admit(scheduler, request)
    _step(scheduler, worker, new=[request])
    _finish(scheduler, worker, request)

    # The step's layer saves stop after a failed load (they would store unfilled blocks).
    transfers = _transfers(exporter)
    assert sorted(map(_described, transfers)) == [
        ("cold", "load", "failed"), ("cold", "save", "aborted"), ("hot", "save", "aborted")]
    assert [span.status.status_code is StatusCode.ERROR for span in transfers if span.name.startswith("kvcompose.transfer ")
            and span.attributes[attr.TRANSFER_OUTCOME] == "failed"] == [True]
    failed = next(span for span in transfers if span.attributes[attr.TRANSFER_OUTCOME] == "failed")
    assert failed.attributes[attr.ERROR_TYPE] == "kvcompose.testing.recording.ScriptedFailure"  # the cause
    assert worker.request_state_sizes() == {}


@pytest.mark.parametrize("later_step", [
    {"raises": ["get_transfer_results"]},  # it gives up what it owes by raising
    {"raises": ["start_load_kv"], "finished_recving": [[], ["r1"]], "failed_recving": [[], ["r1"]]},  # raises, reports
])
def test_an_async_load_whose_child_fails_in_a_later_step_carries_the_error_type(
    vllm_config_with: Callable, exporter: Any, later_step: dict[str, Any]
) -> None:
    """The load is open across steps; the child fails in a step that starts nothing new. The span names the
    exception it raised, not the type of a failure reported without raising."""
    cold = {"matches": {"r1": [[32, True]]}}
    scheduler, worker = _pair(vllm_config_with, {"hot": {}, "cold": cold})
    request = make_request("r1", TRACEPARENT)
    _admit(scheduler, request)
    _step(scheduler, worker, new=[request])
    worker.children[1].connector.script.update(later_step)  # what the child does from the next step on
    _step(scheduler, worker)

    (load,) = [span for span in _transfers(exporter) if span.attributes[attr.TRANSFER_DIRECTION] == "load"]
    assert _described(load) == ("cold", "load", "failed")
    assert load.attributes[attr.ERROR_TYPE] == "kvcompose.testing.recording.ScriptedFailure"


def test_each_kind_of_child_is_tracked_by_how_it_reports_completion() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcompose.adapters.completion import completion_mode

    def mode(connector: str) -> str:
        config = KVTransferConfig(kv_connector=connector, kv_role="kv_both")
        return completion_mode(KVConnectorFactory.get_connector_class(config))

    # NixlConnector resolves to a subclass of another name (NixlPullConnector on vLLM 0.32).
    assert (mode("NixlConnector"), mode("OffloadingConnector"), mode("ExampleConnector")) == (
        "finish", "jobs", "sync")


def test_a_direction_without_copy_times_has_no_copy_series_nor_source() -> None:
    """NIXL's saves record no copy time (in its default pull mode the decode side moves the blocks): their
    lane gets no copy series, so no ``source`` label claims one; its loads' copy times are NIXL's own."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcompose.adapters.completion import copy_source
    from kvcompose.metrics.transfer_series import TransferSeries

    def sources(connector: str) -> dict[str, str | None]:
        config = KVTransferConfig(kv_connector=connector, kv_role="kv_both")
        return copy_source(KVConnectorFactory.get_connector_class(config))

    assert sources("NixlConnector") == {"load": "child", "save": None}
    assert sources("OffloadingConnector") == {"load": "child", "save": "child"}
    assert sources("ExampleConnector") == {"load": "calls", "save": "calls"}

    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    TransferSeries(types, ["connector"], {0: []}, ["remote", "disk"],
                   [sources("NixlConnector"), sources("ExampleConnector")], (0.1, 1.0))
    copy_lanes = {(sample.labels["connector"], sample.labels["direction"], sample.labels["source"])
                  for metric in registry.collect() for sample in metric.samples
                  if sample.name in ("kvcompose_transfer_copy_seconds_count", "kvcompose_transfer_copied_bytes_total")}
    assert copy_lanes == {("remote", "load", "child"), ("disk", "load", "calls"), ("disk", "save", "calls")}


def test_engine_wait_and_copy_time_are_the_time_inside_the_childs_blocking_calls(vllm_config_with: Callable,
                                                                                exporter: Any) -> None:
    """A synchronous disk child that takes time to load and save, timed by itself: kvcompose's engine wait is the
    time inside its blocking calls, and so is each transfer's copy time, not the forward pass between them (which
    the lifetime of a layer-wise save holds)."""
    from vllm.v1.outputs import KVConnectorOutput

    kv_cache, _ = _kv_cache()
    copies = {"start_load_kv": 0.02, "wait_for_layer_load": 0.002, "save_kv_layer": 0.004, "wait_for_save": 0.003}
    recording.TIMINGS.pop("transfers/disk", None)
    scheduler, worker = _pair(vllm_config_with, {"disk": {"sleep_s": copies, "matches": {"r1": [[32, False]]}}},
                              kv_cache)
    request = make_request("r1", TRACEPARENT)
    _admit(scheduler, request)
    worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output(new=[request], blocks=[1, 2, 3])))
    worker.start_load_kv(None)
    forward_s = 0.03
    for layer in range(2):
        worker.wait_for_layer_load(f"model.layers.{layer}")
        time.sleep(forward_s / 2)  # the layer's forward pass
        worker.save_kv_layer(f"model.layers.{layer}", None, None)
    worker.wait_for_save()
    worker.get_transfer_results(set())
    worker.get_block_ids_with_load_errors()
    scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker.build_connector_worker_meta()))
    worker.clear_connector_metadata()
    table = worker.get_kv_connector_stats().transfers

    timed = recording.TIMINGS["transfers/disk"]
    inside = {direction: sum(seconds for method, seconds in timed if OPERATIONS[method].blocking == direction)
              for direction in ("load", "save")}
    assert [method for method, _ in timed].count("save_kv_layer") == 2
    for direction in ("load", "save"):  # kvcompose's clock reads sit just outside the child's
        assert inside[direction] <= table.engine_wait("disk", direction) <= inside[direction] + 0.002
    spans = {span.attributes[attr.TRANSFER_DIRECTION]: span for span in _transfers(exporter)}
    for direction in ("load", "save"):
        copy_s = spans[direction].attributes[attr.TRANSFER_COPY_SECONDS]
        assert copy_s == pytest.approx(table.engine_wait("disk", direction), abs=1e-6)  # the step's only transfer
        assert spans[direction].attributes[attr.TRANSFER_COPY_SOURCE] == "calls"
    save = spans["save"]
    assert (save.end_time - save.start_time) / 1e9 > copies["start_load_kv"] + forward_s  # bound to wait_for_save
    assert table.copy_seconds("disk", "save") == (1, pytest.approx(inside["save"], abs=0.002))
