"""KVComposeStats and the per-child recorder: merging, bounds, reset."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompose.config import DEFAULT_LATENCY_BUCKETS
from kvcompose.metrics.histogram import BucketHistogram, quantile
from kvcompose.metrics.recorder import PipelineRecorder
from kvcompose.metrics.stats import KVComposeStats

BOUNDS = (0.001, 0.01, 0.1)
OPS = ("lookup", "save_kv_layer", "start_load_kv")
CHILDREN = ("hot", "cold", "remote")

# Integer-valued sums keep float addition exact, so equality is exact.
histograms = st.fixed_dictionaries({
    "n": st.lists(st.integers(0, 50), min_size=4, max_size=4),
    "s": st.lists(st.integers(0, 1000).map(float), min_size=4, max_size=4),
})
child_payloads = st.fixed_dictionaries({
    "ops": st.dictionaries(st.sampled_from(OPS), histograms, max_size=3),
    "errors": st.dictionaries(st.sampled_from(OPS), st.dictionaries(st.sampled_from(["OSError", "KeyError"]),
                                                                  st.integers(1, 5), max_size=2), max_size=2),
    "counters": st.fixed_dictionaries({k: st.integers(0, 100) for k in
                                       ("lookup_hits", "lookup_misses", "matched_tokens", "loaded_tokens",
                                        "load_error_blocks")}),
})
payloads = st.fixed_dictionaries({"children": st.dictionaries(st.sampled_from(CHILDREN), child_payloads, max_size=3)})


def merged(*parts: dict[str, Any]) -> dict[str, Any]:
    stats = KVComposeStats.from_payload(copy.deepcopy(parts[0]))
    for part in parts[1:]:
        stats = stats.aggregate(KVComposeStats.from_payload(copy.deepcopy(part)))
    return json.loads(json.dumps(stats.to_dict(), sort_keys=True))


def canonical(payload: dict[str, Any]) -> dict[str, Any]:
    """Drop empty error maps so ``{}`` and absent compare equal."""
    for child in payload["children"].values():
        child["errors"] = {op: e for op, e in child["errors"].items() if e}
    return payload


@settings(max_examples=200, deadline=None)
@given(payloads, payloads, payloads)
def test_aggregate_is_associative_and_commutative(a: dict[str, Any], b: dict[str, Any], c: dict[str, Any]) -> None:
    assert canonical(merged(a, b)) == canonical(merged(b, a))
    left = canonical(merged(merged(a, b), c))
    right = canonical(merged(a, merged(b, c)))
    assert left == right


@settings(max_examples=100, deadline=None)
@given(payloads, payloads)
def test_aggregate_does_not_modify_its_inputs(a: dict[str, Any], b: dict[str, Any]) -> None:
    first, second = KVComposeStats.from_payload(copy.deepcopy(a)), KVComposeStats.from_payload(copy.deepcopy(b))
    before = json.dumps(second.to_dict(), sort_keys=True)
    first.aggregate(second)
    assert json.dumps(second.to_dict(), sort_keys=True) == before


def test_histogram_buckets_follow_prometheus_le() -> None:
    h = BucketHistogram(BOUNDS)
    for value in (0.0005, 0.001, 0.002, 0.1, 5.0):
        h.observe(value)
    payload = h.take()
    assert payload is not None
    assert payload["n"] == [2, 1, 1, 1]
    assert payload["s"] == pytest.approx([0.0015, 0.002, 0.1, 5.0])
    assert h.take() is None


def test_quantile_interpolates_like_histogram_quantile() -> None:
    assert quantile(BOUNDS, [0, 10, 0, 0], 0.5) == pytest.approx(0.0055)
    assert quantile(BOUNDS, [0, 0, 0, 3], 0.99) == 0.1
    assert quantile(BOUNDS, [0, 0, 0, 0], 0.5) is None


class Failing(Exception):
    pass


def test_recorder_counts_calls_errors_and_results_then_resets() -> None:
    recorder = PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, ["hot"], per_layer=True)
    lookup = recorder.wrap("hot", "get_num_new_matched_tokens", lambda request, n: (n, False))
    alloc = recorder.wrap("hot", "update_state_after_alloc", lambda request, blocks, n: None)
    errors = recorder.wrap("hot", "get_block_ids_with_load_errors", lambda: {3, 4})

    def boom(*args: Any) -> None:
        raise Failing

    save = recorder.wrap("hot", "save_kv_layer", boom)
    assert recorder.wrap("hot", "shutdown", boom) is boom  # not a recorded operation
    assert lookup(None, 32) == (32, False) and lookup(None, 0) == (0, False)
    alloc(None, None, 32)
    assert errors() == {3, 4}
    with pytest.raises(Failing):
        save("layer.0", None, None)
    payload = recorder.take()["hot"]
    assert payload["counters"] == {"lookup_hits": 1, "lookup_misses": 1, "matched_tokens": 32,
                                   "loaded_tokens": 32, "load_error_blocks": 2}
    assert payload["errors"] == {"save_kv_layer": {"Failing": 1}}
    assert sum(payload["ops"]["lookup"]["n"]) == 2 and sum(payload["ops"]["save_kv_layer"]["n"]) == 1
    assert recorder.take() == {}
    assert KVComposeStats(data={"children": recorder.take()}).is_empty()


def test_payload_size_is_bounded_whatever_the_traffic() -> None:
    def size_after(calls: int) -> int:
        recorder = PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, list(CHILDREN), per_layer=True)
        save = {c: recorder.wrap(c, "save_kv_layer", lambda *a: None) for c in CHILDREN}
        for i in range(calls):
            save[CHILDREN[i % 3]](f"layer.{i}", None, None)
        return _leaves(KVComposeStats(data={"children": recorder.take()}).to_dict())

    bound = len(CHILDREN) * 1 * 2 * (len(DEFAULT_LATENCY_BUCKETS) + 1) + len(CHILDREN) * 5
    assert size_after(300) == size_after(30_000) <= bound


def _leaves(value: Any) -> int:
    if isinstance(value, dict):
        return sum(_leaves(v) for v in value.values())
    if isinstance(value, list):
        return sum(_leaves(v) for v in value)
    return 1


def test_per_layer_operations_are_timed_only_on_request() -> None:
    call = lambda *args: None  # noqa: E731
    assert PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, ["hot"]).wrap("hot", "save_kv_layer", call) is call
    assert PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, ["hot"], per_layer=True).wrap(
        "hot", "save_kv_layer", call) is not call


def test_metrics_off_wraps_nothing() -> None:
    recorder = PipelineRecorder(False, DEFAULT_LATENCY_BUCKETS, ["hot"])
    call = lambda: None  # noqa: E731
    assert recorder.wrap("hot", "save_kv_layer", call) is call and recorder.take() == {}


def test_reduce_reports_per_child_numbers() -> None:
    recorder = PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, ["hot"])
    recorder.wrap("hot", "get_num_new_matched_tokens", lambda r, n: (16, False))(None, 0)
    reduced = KVComposeStats(data={"children": recorder.take()}).reduce()
    assert reduced["hot.lookup_hits"] == 1 and reduced["hot.lookup.calls"] == 1
