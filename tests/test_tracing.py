"""Spans from a scheduler-side and a worker-side composite, read from the in-memory exporter."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from kvcompose.operations import OPERATIONS
from kvcompose.testing import recording
from kvcompose.testing.steps import forward_step
from kvcompose import names as attr
from kvcompose.tracing.exporters import traces_url
from kvcompose.tracing.pipeline import SUMMARY_FIELDS, summary_key
from kvcompose.tracing.records import IdSource

from .connector_support import RECORDING, composite_pair, make_blocks, make_request, scheduler_output
from .span_support import wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
ALLOWED_ATTRIBUTES = {
    attr.CONNECTOR_NAME, attr.CONNECTOR_INDEX, attr.CONNECTOR_CLASS, attr.ROLE, attr.PIPELINE, attr.REQUEST_ID,
    attr.COMPUTED_TOKENS, attr.MATCHED_TOKENS, attr.EXTERNAL_TOKENS, attr.LOAD_ASYNC, attr.SAVE_ASYNC, attr.BLOCKS,
    attr.LOOKUP_DEFERRALS,
    attr.LOADED_BY, attr.LOADED_TOKENS, attr.REQUESTS, attr.LAYER, attr.FINISHED_SENDING, attr.FINISHED_RECVING,
    attr.ERROR_TYPE, attr.TRANSFER_DIRECTION, attr.TRANSFER_BLOCKS, attr.TRANSFER_BYTES, attr.TRANSFER_OUTCOME,
    attr.TRANSFER_COPY_SECONDS, attr.TRANSFER_COPY_SOURCE,
    *(summary_key(child, direction, name) for child in ("hot", "cold") for direction in ("load", "save")
      for name in SUMMARY_FIELDS),
}


def _pipeline(tracing: dict[str, Any], hot: dict[str, Any] | None = None) -> dict[str, Any]:
    def child(name: str, script: dict[str, Any]) -> dict[str, Any]:
        key = f"tracing/{name}"
        recording.CALL_LOGS.pop(key, None)
        return {"name": name, **RECORDING, "config": {"log": key, "script": script}}

    return {"version": 1, "name": "traced", "tracing": {"enabled": True, **tracing},
            "children": [child("hot", hot or {}), child("cold", {"matches": {"r1": [[32, False]]}})]}


def _serve_one_request(scheduler: Any, worker: Any, request: Any, layers: int = 2) -> Any:
    """Lookup, allocation, one worker step (its worker metadata back to the scheduler) and the request's end, as
    vLLM orders them."""
    from vllm.v1.outputs import KVConnectorOutput

    tokens, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(1, 2), tokens)
    metadata = scheduler.build_connector_meta(scheduler_output(new=[request]))
    worker.bind_connector_metadata(metadata)
    forward_step(worker, layers)
    worker_metadata = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker_metadata))
    scheduler.request_finished(request, [1, 2])
    return metadata


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    grouped: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        grouped.setdefault(span.name, []).append(span)
    return grouped


def _connectors(spans: list[ReadableSpan]) -> list[str]:
    return [span.attributes[attr.CONNECTOR_NAME] for span in spans]


def test_request_granularity_joins_the_incoming_trace(vllm_config_with: Callable, exporter: Any) -> None:
    """A traced request's trace holds its request span, its lookups and its transfers (each named by direction
    and child); its other calls are quick and did not fail, so they make no span."""
    scheduler, worker = composite_pair(vllm_config_with, _pipeline({"granularity": "request"}))
    _serve_one_request(scheduler, worker, make_request("r1", TRACEPARENT))

    spans = exporter.get_finished_spans()
    named = _by_name(spans)
    assert set(named) == {"kvcompose.request", "kvcompose.lookup", "kvcompose.transfer load cold",
                          "kvcompose.transfer save cold", "kvcompose.transfer save hot"}
    assert {format(span.context.trace_id, "032x") for span in spans} == {TRACE_ID}

    (request_span,) = named["kvcompose.request"]
    assert format(request_span.parent.span_id, "016x") == PARENT_ID
    for name in set(named) - {"kvcompose.request"}:
        assert {span.parent.span_id for span in named[name]} == {request_span.context.span_id}, name
        assert {span.attributes[attr.REQUEST_ID] for span in named[name]} == {"r1"}
    assert _connectors(named["kvcompose.lookup"]) == ["hot", "cold"]
    assert [s.attributes[attr.MATCHED_TOKENS] for s in named["kvcompose.lookup"]] == [0, 32]
    (load,) = named["kvcompose.transfer load cold"]
    assert load.attributes[attr.ROLE] == "worker" and load.attributes[attr.TRANSFER_COPY_SOURCE] == "calls"
    assert 0 < load.attributes[attr.TRANSFER_COPY_SECONDS] * 1e9 <= load.end_time - load.start_time

    # The summary: who loaded what, and each transfer's lifetime and copy time, as the worker reported them.
    summary = request_span.attributes
    assert (summary[attr.LOADED_BY], summary[attr.LOADED_TOKENS]) == ("cold", 32)
    assert summary[summary_key("cold", "load", "lifetime_s")] == pytest.approx(
        (load.end_time - load.start_time) / 1e9, abs=1e-6)
    assert summary[summary_key("cold", "load", "copy_s")] == pytest.approx(
        load.attributes[attr.TRANSFER_COPY_SECONDS], abs=1e-6)
    assert {summary_key(child, "save", "lifetime_s") for child in ("hot", "cold")} <= set(summary)
    assert summary_key("hot", "load", "lifetime_s") not in summary  # hot loaded nothing
    assert all(set(span.attributes) <= ALLOWED_ATTRIBUTES for span in spans)
    assert scheduler._instrumentation.tracer.open_requests == 0


@pytest.mark.parametrize("granularity", ["request", "step"])
def test_a_deferred_lookup_leaves_one_lookup_span_per_child_that_counts_the_deferrals(
    vllm_config_with: Callable, exporter: Any, granularity: str,
) -> None:
    """The second child answers "ask again later" twice (vLLM asks again each step) while the first answers every
    time: at request granularity the trace holds one lookup per child, the one of the round vLLM admitted the
    request on, with the deferrals before it; at step granularity every lookup, each with the deferrals so far."""
    pipeline = _pipeline({"granularity": granularity})
    pipeline["children"][1]["config"]["script"]["matches"]["r1"] = [[None, True], [None, True], [32, True]]
    scheduler, worker = composite_pair(vllm_config_with, pipeline)
    request = make_request("r1", TRACEPARENT)
    for _ in range(2):
        assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    _serve_one_request(scheduler, worker, request)

    lookups = [(span.attributes[attr.CONNECTOR_NAME], span.attributes.get(attr.MATCHED_TOKENS),
                span.attributes[attr.LOOKUP_DEFERRALS])
               for span in sorted(exporter.get_finished_spans(), key=lambda span: span.start_time)
               if span.name == "kvcompose.lookup"]
    if granularity == "request":
        assert sorted(lookups) == [("cold", 32, 2), ("hot", 0, 0)]
    else:
        assert lookups == [("hot", 0, 0), ("cold", None, 0), ("hot", 0, 0), ("cold", None, 1), ("hot", 0, 0),
                           ("cold", 32, 2)]
    assert scheduler._instrumentation.tracer.open_requests == 0


def test_at_request_granularity_slow_calls_make_spans_under_their_request(vllm_config_with: Callable,
                                                                         exporter: Any) -> None:
    """With ``slow_call_ms: 0`` every call is slow: the scheduler's calls about the request, and the worker's calls
    in the step that moves its KV, all under the request's span."""
    scheduler, worker = composite_pair(vllm_config_with, _pipeline({"granularity": "request", "slow_call_ms": 0}))
    _serve_one_request(scheduler, worker, make_request("r1", TRACEPARENT))

    named = _by_name(exporter.get_finished_spans())
    (request_span,) = named["kvcompose.request"]
    for name in ("kvcompose.update_state_after_alloc", "kvcompose.request_finished", "kvcompose.start_load_kv",
                 "kvcompose.wait_for_save"):
        assert sorted(_connectors(named[name])) == ["cold", "hot"], name
        assert {span.parent.span_id for span in named[name]} == {request_span.context.span_id}, name
    assert "kvcompose.step" not in named and "kvcompose.save_kv_layer" not in named


def test_step_granularity_adds_linked_step_spans(vllm_config_with: Callable, exporter: Any) -> None:
    scheduler, worker = composite_pair(vllm_config_with, _pipeline({"granularity": "step"}))
    _serve_one_request(scheduler, worker, make_request("r1", TRACEPARENT))

    named = _by_name(exporter.get_finished_spans())
    (step,) = named["kvcompose.step"]
    (request_span,) = named["kvcompose.request"]
    assert [link.context.span_id for link in step.links] == [request_span.context.span_id]
    for name in ("kvcompose.start_load_kv", "kvcompose.wait_for_save", "kvcompose.get_transfer_results"):
        assert {span.parent.span_id for span in named[name]} == {step.context.span_id}, name
    assert _connectors(named["kvcompose.start_load_kv"]) == ["hot", "cold"]
    assert "kvcompose.save_kv_layer" not in named


def test_a_breaker_opening_mid_step_leaves_the_rest_of_the_step_traced(vllm_config_with: Callable,
                                                                      exporter: Any) -> None:
    """The hot child's failed start_load_kv opens its circuit, which makes its calls again mid-step; the
    step's later calls still run traced. (Metrics off: no call is the one sampled for timing, which would
    pick its calls itself.)"""
    pipeline = _pipeline({"granularity": "step"}, hot={"raises": ["start_load_kv"]})
    pipeline["children"][0]["circuit_breaker"] = {"failures": 1}
    pipeline["metrics"] = {"enabled": False}
    scheduler, worker = composite_pair(vllm_config_with, pipeline)
    _serve_one_request(scheduler, worker, make_request("r1", TRACEPARENT))

    named = _by_name(exporter.get_finished_spans())
    (step,) = named["kvcompose.step"]
    assert worker._guards[0].state.name == "OPEN"
    for name in ("kvcompose.wait_for_save", "kvcompose.get_transfer_results"):
        assert "cold" in _connectors(named[name]), name
        assert {span.parent.span_id for span in named[name]} == {step.context.span_id}, name


def test_decode_only_steps_make_no_step_span(vllm_config_with: Callable, exporter: Any) -> None:
    scheduler, worker = composite_pair(vllm_config_with, _pipeline({"granularity": "step"}))
    request = make_request("r2", TRACEPARENT)  # no child has it: nothing to load
    scheduler.get_num_new_matched_tokens(request, 0)
    for output in (scheduler_output(new=[request]), scheduler_output(cached=["r2"]), scheduler_output(cached=["r2"])):
        worker.bind_connector_metadata(scheduler.build_connector_meta(output))
        worker.start_load_kv(None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
    scheduler.request_finished(request, [])

    assert len(_by_name(exporter.get_finished_spans())["kvcompose.step"]) == 1  # the prefill step only


def test_layer_granularity_adds_per_layer_spans(vllm_config_with: Callable, exporter: Any) -> None:
    scheduler, worker = composite_pair(vllm_config_with, _pipeline({"granularity": "layer"}))
    _serve_one_request(scheduler, worker, make_request("r1", TRACEPARENT), layers=3)

    named = _by_name(exporter.get_finished_spans())
    saves = named["kvcompose.save_kv_layer"]
    assert len(saves) == 3 * 2  # layers x saving children
    assert {span.attributes[attr.LAYER] for span in saves} == {f"model.layers.{i}" for i in range(3)}
    assert {span.parent.span_id for span in saves} == {named["kvcompose.step"][0].context.span_id}


def test_without_traceparent_each_request_is_its_own_trace(vllm_config_with: Callable, exporter: Any) -> None:
    scheduler, worker = composite_pair(vllm_config_with, _pipeline({}))
    _serve_one_request(scheduler, worker, make_request("r1"))
    _serve_one_request(scheduler, worker, make_request("r2"))

    requests = _by_name(exporter.get_finished_spans())["kvcompose.request"]
    assert [span.parent for span in requests] == [None, None]
    assert len({span.context.trace_id for span in requests}) == 2


@pytest.mark.parametrize("on_error", ["isolate", "raise"])
def test_a_failing_child_call_is_an_error_span(vllm_config_with: Callable, exporter: Any, on_error: str) -> None:
    pipeline = _pipeline({}, hot={"raises": ["get_num_new_matched_tokens"]})
    pipeline["children"][0]["on_error"] = on_error
    scheduler, _ = composite_pair(vllm_config_with, pipeline)
    request = make_request("r1", TRACEPARENT)
    if on_error == "raise":
        with pytest.raises(recording.ScriptedFailure):
            scheduler.get_num_new_matched_tokens(request, 0)
    else:  # a miss on "hot"; "cold" still answers
        assert scheduler.get_num_new_matched_tokens(request, 0) == (32, False)
    scheduler.request_finished(request, [])

    lookups = _by_name(exporter.get_finished_spans())["kvcompose.lookup"]
    failed = lookups[0]
    assert failed.attributes[attr.CONNECTOR_NAME] == "hot"
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes[attr.ERROR_TYPE] == "kvcompose.testing.recording.ScriptedFailure"
    assert "scripted failure" not in str(failed.status.description)  # messages stay out of spans


def test_unsampled_requests_create_no_spans_and_no_metadata(vllm_config_with: Callable, exporter: Any) -> None:
    tracing = {"sample_ratio": 0.0}
    scheduler, worker = composite_pair(vllm_config_with, _pipeline(tracing))
    metadata = _serve_one_request(scheduler, worker, make_request("r1"))

    assert exporter.get_finished_spans() == ()
    assert metadata.traced_requests is None
    assert scheduler._instrumentation.tracer.open_requests == 0


def test_an_idle_engines_spans_are_shipped_by_the_outbox_thread_with_no_further_call(
    vllm_config_with: Callable, exporter: Any
) -> None:
    """An idle scheduler schedules no step, and nothing on the engine's thread ships: the outbox's thread
    takes what the sampled request recorded within a (backed-off) drain interval (an unsampled last request once left
    them waiting for the next request)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvcompose.tracing.outbox import DRAIN_EVERY_S

    scheduler, _ = composite_pair(vllm_config_with, _pipeline({"sample_ratio": 0.0}))
    sampled, unsampled = make_request("r1", TRACEPARENT), make_request("r2")
    for request in (sampled, unsampled):
        scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.request_finished(sampled, [])
    scheduler.request_finished(unsampled, [])

    def shipped() -> dict[str, list[Any]]:  # read without the test's flush
        return _by_name(InMemorySpanExporter.get_finished_spans(exporter))

    wait_until(lambda: "kvcompose.request" in shipped(), timeout_s=50 * DRAIN_EVERY_S, poll_s=DRAIN_EVERY_S / 4)
    spans = shipped()
    (request_span,) = spans["kvcompose.request"]
    assert request_span.attributes[attr.REQUEST_ID] == "r1"
    assert _connectors(spans["kvcompose.lookup"]) == ["hot", "cold"]


def test_tracing_off_wraps_nothing(vllm_config_with: Callable, exporter: Any) -> None:
    pipeline = _pipeline({})
    pipeline["tracing"]["enabled"] = False
    pipeline["metrics"] = {"enabled": False}
    scheduler, worker = composite_pair(vllm_config_with, pipeline)
    _serve_one_request(scheduler, worker, make_request("r1", TRACEPARENT))

    assert scheduler._instrumentation is None and worker._instrumentation is None
    assert exporter.get_finished_spans() == ()
    hot = worker.children[0]
    assert worker._calls.save_kv_layer[0] == hot.connector.save_kv_layer  # the child's own bound method
    assert "wait_for_save" not in vars(worker)  # the composite's own method, not wrapped


def test_nothing_is_installed_on_the_composites(vllm_config_with: Callable, exporter: Any) -> None:
    """Instrumentation is composition: every method vLLM calls is the composite's class's own."""
    from kvcompose.operations import CONNECTOR_OPERATIONS

    scheduler, worker = composite_pair(vllm_config_with, _pipeline({"granularity": "step"}))
    _serve_one_request(scheduler, worker, make_request("r1", TRACEPARENT))
    assert not (set(vars(scheduler)) | set(vars(worker))) & set(CONNECTOR_OPERATIONS)


@pytest.mark.parametrize(("endpoint", "url"), [
    ("http://jaeger:4318", "http://jaeger:4318/v1/traces"),
    ("http://jaeger:4318/", "http://jaeger:4318/v1/traces"),
    ("http://collector:4318/custom/path", "http://collector:4318/custom/path"),
])
def test_endpoint_accepts_a_base_url_or_a_traces_url(endpoint: str, url: str) -> None:
    assert traces_url(endpoint) == url


def test_ids_do_not_repeat_when_pythons_random_is_seeded_alike() -> None:
    """vLLM seeds ``random`` the same way in every process of a prefill/decode pair."""
    ids = IdSource()
    random.seed(0)
    first = (ids.trace_id(), ids.span_id())
    random.seed(0)
    assert (ids.trace_id(), ids.span_id()) != first


@pytest.mark.parametrize("sample_ratio", [0.0, 0.5])
def test_a_sampled_requests_step_spans_are_kept_and_isolated_failures_answer_neutrally(
    vllm_config_with: Callable, exporter: Any, sample_ratio: float
) -> None:
    """The shipped hang: under a ratio below 1 a step span could be dropped on its own, and a failed
    step call's isolation answer was then read for span attributes; the error escaped into vLLM's loop.
    A request its caller sampled keeps every span, step spans included, whatever the ratio."""
    failing = {"raises": ["get_transfer_results", "get_block_ids_with_load_errors"]}
    pipeline = _pipeline({"granularity": "step", "sample_ratio": sample_ratio}, hot=failing)
    scheduler, worker = composite_pair(vllm_config_with, pipeline)
    request = make_request("r1", TRACEPARENT)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(1, 2), 0)
    worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output(new=[request])))
    results, load_errors = forward_step(worker, finished={"r1"})
    worker.clear_connector_metadata()
    scheduler.request_finished(request, [1, 2])

    assert (results.finished_sending, results.finished_recving, load_errors) == (set(), set(), set())
    assert worker.get_kv_connector_stats().calls.errors["hot"] == {
        "get_transfer_results": {"ScriptedFailure": 1}, "get_block_ids_with_load_errors": {"ScriptedFailure": 1}}
    spans = _by_name(exporter.get_finished_spans())
    (step,) = spans["kvcompose.step"]
    failed = [span for span in spans["kvcompose.get_transfer_results"] if span.attributes[attr.CONNECTOR_NAME] == "hot"]
    assert failed[0].parent.span_id == step.context.span_id
    assert failed[0].status.status_code is StatusCode.ERROR
    assert failed[0].attributes[attr.ERROR_TYPE] == "kvcompose.testing.recording.ScriptedFailure"
    assert attr.FINISHED_SENDING not in failed[0].attributes


def test_a_result_of_an_unexpected_shape_is_traced_without_attributes_never_raised(
    vllm_config_with: Callable, exporter: Any
) -> None:
    """Tracing must not break generation: a child call answering with a malformed result is traced
    without result attributes, and the caller gets the result unchanged."""
    scheduler, _ = composite_pair(vllm_config_with, _pipeline({}))
    request = make_request("r1", TRACEPARENT)
    malformed = scheduler._instrumentation.observe(scheduler.children[0].spec, OPERATIONS["get_num_new_matched_tokens"],
                                                   lambda request, computed: (32,))  # one value, where two belong
    assert malformed(request, 0) == (32,)
    scheduler.request_finished(request, [])

    (lookup,) = [span for span in exporter.get_finished_spans() if span.name == "kvcompose.lookup"]
    assert attr.MATCHED_TOKENS not in lookup.attributes and lookup.attributes[attr.REQUEST_ID] == "r1"
