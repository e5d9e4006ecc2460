"""KVComposeStats, its CallTable and the per-process recorder: merging, buckets, bounds, reset.

The merge properties cover every part of the payload: calls, breakers, transfers and telemetry
(the transfer recorder and series are tested in test_transfer_metrics.py)."""

from __future__ import annotations

import json
import time
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompose.config import DEFAULT_LATENCY_BUCKETS
from kvcompose.metrics import recorder as recorder_module
from kvcompose.metrics.recorder import PipelineRecorder
from kvcompose.operations import DIRECTIONS, FAILED_LOOKUP, OPERATIONS
from kvcompose.wire import calls as table_module
from kvcompose.wire.calls import COUNTERS, OPS, CallTable
from kvcompose.wire.stats import TELEMETRY_KEY, TRANSFERS_KEY, KVComposeStats
from kvcompose.wire.telemetry import DROP_REASONS
from kvcompose.wire.transfers import FAILURES, TransferTable

BOUNDS = (0.001, 0.01, 0.1)

CHILDREN = ("hot", "cold", "remote")
LANES = len(CHILDREN) * len(DIRECTIONS)
TRACE_IDS = ("0af7651916cd43dd8448eb211c80319c", "4bf92f3577b34da6a3ce929d0e0e4736", "1" * 32)


def _table_dicts() -> st.SearchStrategy[dict[str, Any]]:
    cells = len(CHILDREN) * len(OPS) * (len(BOUNDS) + 1)
    # Integer-valued sums keep float addition exact, so equality is exact.
    return st.builds(
        lambda used, counters, errors, load_errors: CallTable(
            CHILDREN, len(BOUNDS) + 1, {cell: [count, float(seconds)] for cell, (count, seconds) in used.items()},
            counters, errors, load_errors).to_dict(),
        st.dictionaries(st.integers(0, cells - 1), st.tuples(st.integers(1, 50), st.integers(0, 1000)), max_size=40),
        st.lists(st.integers(0, 100), min_size=len(CHILDREN) * len(COUNTERS), max_size=len(CHILDREN) * len(COUNTERS)),
        st.dictionaries(st.sampled_from(CHILDREN), st.dictionaries(
            st.sampled_from(OPS), st.dictionaries(st.sampled_from(["OSError", "KeyError"]), st.integers(1, 5),
                                                  min_size=1, max_size=2), min_size=1, max_size=2), max_size=2),
        # Few steps and block ids, so that merged payloads share some.
        st.dictionaries(st.sampled_from(CHILDREN), st.dictionaries(
            st.integers(1, 3), st.sets(st.integers(0, 6), min_size=1, max_size=4), min_size=1, max_size=2), max_size=2),
    )


def _transfer_dicts() -> st.SearchStrategy[dict[str, Any]]:
    # Exemplar times from a small set, so ties (broken by trace id) happen.
    cells = LANES * (len(BOUNDS) + 1)
    used_cells = st.dictionaries(st.integers(0, cells - 1), st.tuples(st.integers(1, 50), st.integers(0, 1000)),
                                 max_size=12)
    return st.builds(
        lambda used, copied, moved, in_flight, failures, waited, exemplars: TransferTable(
            CHILDREN, len(BOUNDS) + 1, {cell: [count, float(seconds)] for cell, (count, seconds) in used.items()},
            {cell: [count, float(seconds)] for cell, (count, seconds) in copied.items()},
            moved, in_flight, failures, [float(seconds) for seconds in waited],
            {cell: [float(at), trace, float(seconds)] for cell, (trace, seconds, at) in exemplars.items()},
        ).to_dict(),
        used_cells, used_cells,
        st.lists(st.integers(0, 2**40), min_size=LANES, max_size=LANES),
        st.lists(st.integers(-5, 5), min_size=LANES, max_size=LANES),
        st.lists(st.integers(0, 9), min_size=LANES * len(FAILURES), max_size=LANES * len(FAILURES)),
        st.lists(st.integers(0, 1000), min_size=LANES, max_size=LANES),
        st.dictionaries(st.integers(0, cells - 1), st.tuples(
            st.sampled_from(TRACE_IDS), st.integers(0, 100), st.integers(0, 3)), max_size=6),
    )


payloads = st.fixed_dictionaries({
    "calls": st.none() | _table_dicts(),
    "breakers": st.dictionaries(st.sampled_from(CHILDREN), st.fixed_dictionaries(
        {"state": st.integers(0, 2), "opens": st.integers(0, 3)}), max_size=2),
    TRANSFERS_KEY: st.none() | _transfer_dicts(),
    TELEMETRY_KEY: st.none() | st.builds(
        lambda dropped, queued, restarts: {"dropped": dropped, "spans_queued": queued, "exporter_restarts": restarts},
        st.dictionaries(st.sampled_from(DROP_REASONS), st.integers(1, 100), max_size=2),
        st.none() | st.integers(0, 4096), st.integers(0, 3)),
})


def merged(*parts: dict[str, Any], dense: bool = False) -> dict[str, Any]:
    """The parts folded as vLLM's aggregator does; ``dense``: every other part shipped dense, as a large engine's."""
    tables = [KVComposeStats.from_payload(part) for part in parts]
    for index, table in enumerate(tables):
        if dense and index % 2 and table.calls is not None:
            table.calls.densify()
    stats = tables[0]
    for table in tables[1:]:
        stats = stats.aggregate(table)
    return canonical(stats.to_dict())


def canonical(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload with its cells (and exemplars) in index order, as JSON sees it."""
    if (calls := payload["calls"]) is not None:
        _sort_cells(calls["cells"])
    if (transfers := payload[TRANSFERS_KEY]) is not None:
        _sort_cells(transfers["cells"])
        _sort_cells(transfers["copy"])
        transfers["exemplars"].sort()
    return json.loads(json.dumps(payload, sort_keys=True))


def _sort_cells(cells: dict[str, Any]) -> None:
    rows = sorted(zip(cells["cells"], cells["counts"], cells["seconds"], strict=True))
    cells["cells"], cells["counts"], cells["seconds"] = ([row[i] for row in rows] for i in range(3))


@settings(max_examples=200, deadline=None)
@given(payloads, payloads, payloads)
def test_aggregate_is_associative_and_commutative(a: dict[str, Any], b: dict[str, Any], c: dict[str, Any]) -> None:
    assert merged(a, b) == merged(b, a)
    assert merged(merged(a, b), c) == merged(a, merged(b, c))


@settings(max_examples=50, deadline=None)
@given(st.lists(payloads, min_size=2, max_size=12))
def test_merging_through_dense_arrays_adds_up_the_same(parts: list[dict[str, Any]]) -> None:
    sparse = merged(*parts)
    assert merged(*parts, dense=True) == sparse
    with mock.patch.object(table_module, "SPARSE_MERGE_LIMIT", 0):  # every merge adds dense arrays
        assert merged(*parts) == sparse


@settings(max_examples=100, deadline=None)
@given(payloads, payloads)
def test_aggregate_does_not_modify_its_inputs(a: dict[str, Any], b: dict[str, Any]) -> None:
    first, second = KVComposeStats.from_payload(a), KVComposeStats.from_payload(b)
    before = json.dumps(second.to_dict(), sort_keys=True)
    first.aggregate(second)
    first.aggregate(second)
    assert json.dumps(second.to_dict(), sort_keys=True) == before


def test_a_table_taken_over_by_aggregate_is_copied_before_it_is_added_to() -> None:
    # vLLM merges the scheduler's stats into the worker's every step: a worker without a call table takes the
    # scheduler's as it is (no copy), and copies it only when merged into again.
    scheduler = CallTable(CHILDREN, len(BOUNDS) + 1, {0: [1, 0.5]})
    worker = KVComposeStats()
    worker.aggregate(KVComposeStats(data={"calls": scheduler}))
    assert worker.calls is scheduler
    worker.aggregate(KVComposeStats(data={"calls": CallTable(CHILDREN, len(BOUNDS) + 1, {0: [2, 1.0]})}))
    assert worker.calls is not scheduler
    assert worker.calls.cells == {0: [3, 1.5]}
    assert scheduler.cells == {0: [1, 0.5]}


def test_aggregate_does_not_modify_a_childs_native_stats() -> None:
    # A child's own stats (here vLLM's OffloadingConnectorStats) are merged by the child's own aggregate, which
    # adds into its object: one taken over from an input must be copied before it is merged into again.
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    from kvcompose.wire.native import NativeStats, class_path

    stats = OffloadingConnectorStats()
    stats.increase_counter("vllm:kv_offload_load_bytes", 5)
    second = KVComposeStats(data={"native": {"cpu": NativeStats(class_path(OffloadingConnector), stats)}})
    before = repr(second.to_dict())
    first = KVComposeStats()
    first.aggregate(second)
    first.aggregate(second)
    assert repr(second.to_dict()) == before
    assert first.to_dict()["native"]["cpu"]["stats"]["data"] == {"vllm:kv_offload_load_bytes": {(): 10}}


def test_tables_of_different_pipelines_do_not_merge() -> None:
    table = CallTable(("hot", "cold"), len(BOUNDS) + 1)
    with pytest.raises(ValueError, match="different pipelines"):
        table.add(CallTable(("hot", "disk"), len(BOUNDS) + 1))
    with pytest.raises(ValueError, match="different pipelines"):
        table.add(CallTable(("hot", "cold"), len(BOUNDS) + 2))


def test_stats_of_another_kvcompose_version_are_refused_with_a_reason() -> None:
    payload = CallTable(("hot",), 4).to_dict()
    payload["ops"] = payload["ops"][:-1]
    with pytest.raises(ValueError, match="one kvcompose version"):
        CallTable.from_dict(payload)


def test_buckets_follow_prometheus_le() -> None:
    recorder = PipelineRecorder(True, BOUNDS, ["hot", "cold"])
    for seconds in (0.0005, 0.001, 0.002, 0.1, 5.0):
        recorder.timed(0, seconds)
    recorder.timed(1, 0.05)  # the next slot's cells follow
    cells = recorder.take().cells
    assert {cell: count for cell, (count, _) in cells.items() if cell < 4} == {0: 2, 1: 1, 2: 1, 3: 1}
    assert [cells[cell][1] for cell in range(4)] == pytest.approx([0.0015, 0.002, 0.1, 5.0])
    assert cells[len(BOUNDS) + 1 + 2] == [1, 0.05]


def test_calls_of_one_cell_add_up() -> None:
    recorder = PipelineRecorder(True, BOUNDS, ["hot", "cold"])
    recorder.timed(0, 0.002)
    for _ in range(3):
        recorder.timed(1, 0.05)
    assert recorder.take().cells == {1: [1, pytest.approx(0.002)], 4 + 2: [3, pytest.approx(0.15)]}


class Failing(Exception):
    pass


def _boom(*args: Any) -> None:
    raise Failing


def _timed(recorder: PipelineRecorder, child: str, operation: str, call: Any) -> Any:
    """``call``, every call timed as the instrumentation times it; ``call`` itself
    where the recorder does not time the operation."""
    label = recorder.label(OPERATIONS[operation])
    if label is None:
        return call
    slot = recorder.slot(recorder._children.index(child), label)

    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            recorder.timed(slot, time.perf_counter() - start)

    return timed


def test_recorder_counts_calls_errors_and_results_then_resets() -> None:
    from .connector_support import make_request

    recorder = PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, ["hot", "cold"], per_layer=True)
    lookup = _timed(recorder, "hot", "get_num_new_matched_tokens", lambda request, n: (n, False))
    alloc = _timed(recorder, "hot", "update_state_after_alloc", lambda request, blocks, n: None)
    errors = _timed(recorder, "hot", "get_block_ids_with_load_errors", lambda: {3, 4})
    save = _timed(recorder, "cold", "save_kv_layer", _boom)
    assert _timed(recorder, "hot", "shutdown", _boom) is _boom  # not a timed operation
    for request, tokens in ((make_request("r1"), 32), (make_request("r2"), 0)):
        answer = lookup(request, tokens)
        alloc(request, None, tokens)
        recorder.request_admitted([answer], [0], 0 if tokens else None, tokens)
    assert errors() == {3, 4}
    with pytest.raises(Failing) as failure:
        save("layer.0", None, None)
    recorder.count_error("cold", OPERATIONS["save_kv_layer"], failure.value)  # what the child's guard tells it
    recorder.count_load_errors("hot", 1, {3, 4})
    recorder.count_load_errors("cold", 1, range(5))

    table = recorder.take()
    assert table is not None
    assert {name: table.counter("hot", name) for name in COUNTERS} == {
        "lookup_hits": 1, "lookup_misses": 1, "matched_tokens": 32, "loaded_tokens": 32, "forgone_tokens": 0}
    assert not any(table.counter("cold", name) for name in COUNTERS)  # cold was not asked
    assert (table.load_error_blocks("hot"), table.load_error_blocks("cold")) == (2, 5)
    assert table.errors == {"cold": {"save_kv_layer": {"Failing": 1}}}
    assert table.call_count("hot", "lookup") == 2 and table.call_count("cold", "save_kv_layer") == 1
    assert table.call_count("cold", "lookup") == 0
    assert sum(count for count, _ in table.cells.values()) == 6  # every timed call, the failed one too
    assert recorder.take() is None


def test_a_failed_lookup_counts_neither_as_a_hit_nor_as_a_miss() -> None:
    recorder = PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, ["hot", "cold"])
    recorder.request_admitted([FAILED_LOOKUP, (0, False)], [0, 1], None, 0)
    table = recorder.take()
    assert (table.counter("hot", "lookup_misses"), table.counter("cold", "lookup_misses")) == (0, 1)


def test_pending_latencies_are_folded_before_they_pile_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder_module, "MAX_PENDING_CALLS", 8)
    recorder = PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, ["hot"])
    wait = _timed(recorder, "hot", "wait_for_save", lambda: None)
    for _ in range(20):
        wait()
    assert len(recorder._pending) <= 8  # folded twice on the way
    assert recorder.take().call_count("hot", "wait_for_save") == 20


def test_payload_size_is_bounded_whatever_the_traffic() -> None:
    def payload_after(calls: int) -> dict[str, Any]:
        recorder = PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, list(CHILDREN), per_layer=True)
        save = {c: _timed(recorder, c, "save_kv_layer", lambda *a: None) for c in CHILDREN}
        for i in range(calls):
            save[CHILDREN[i % 3]](f"layer.{i}", None, None)
        return KVComposeStats(data={"calls": recorder.take()}).to_dict()

    buckets = len(DEFAULT_LATENCY_BUCKETS) + 1
    every_cell_used = CallTable(CHILDREN, buckets, {cell: [1, 0.5] for cell in range(len(CHILDREN) * len(OPS) * buckets)})
    bound = leaves(KVComposeStats(data={"calls": every_cell_used}).to_dict())
    for calls in (300, 30_000):
        payload = payload_after(calls)
        assert sum(payload["calls"]["cells"]["counts"]) == calls and leaves(payload) <= bound


def leaves(value: Any) -> int:
    """Numbers and strings in a payload: what its size grows with."""
    if isinstance(value, dict):
        return sum(leaves(v) for v in value.values())
    if isinstance(value, list):
        return sum(leaves(v) for v in value)
    return 1


def test_per_layer_operations_are_timed_only_on_request() -> None:
    call = lambda *args: None  # noqa: E731
    assert _timed(PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, ["hot"]), "hot", "save_kv_layer", call) is call
    per_layer = PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, ["hot"], per_layer=True)
    assert _timed(per_layer, "hot", "save_kv_layer", call) is not call


def test_a_large_engines_workers_ship_their_tables_dense() -> None:
    from benchmarks.connectors import kvcompose_connector, pipeline
    from kvcompose.metrics.recorder import DENSE_FROM_WORKERS
    from kvcompose.testing.steps import forward_step

    def worker_stats(workers: int) -> KVComposeStats:
        from kvcompose.wire.metadata import KVComposeMetadata

        worker = kvcompose_connector(pipeline(2), "worker", workers=workers)
        worker.bind_connector_metadata(KVComposeMetadata(per_child=(None, None), report_stats=True))
        forward_step(worker, 2)  # the first step is timed
        stats = worker.get_kv_connector_stats()
        worker.clear_connector_metadata()
        return stats

    small, large = worker_stats(1), worker_stats(DENSE_FROM_WORKERS)
    assert small.calls._dense is None and large.calls._dense is not None
    assert large.calls.call_count("c0", "start_load_kv") == small.calls.call_count("c0", "start_load_kv") == 1
    assert large.aggregate(small).calls.call_count("c1", "wait_for_save") == 2


def test_metrics_off_wraps_nothing() -> None:
    recorder = PipelineRecorder(False, DEFAULT_LATENCY_BUCKETS, ["hot"])
    call = lambda: None  # noqa: E731
    assert _timed(recorder, "hot", "wait_for_save", call) is call and recorder.take() is None


def test_reduce_reports_per_child_numbers() -> None:
    from .connector_support import make_request

    recorder = PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, ["hot"])
    request = make_request("r1")
    answer = _timed(recorder, "hot", "get_num_new_matched_tokens", lambda r, n: (16, False))(request, 0)
    recorder.request_admitted([answer], [0], 0, 16)
    reduced = KVComposeStats(data={"calls": recorder.take()}).reduce()
    assert reduced["hot.lookup_hits"] == 1 and reduced["hot.lookup.calls"] == 1
    assert reduced["hot.lookup.mean_ms"] >= 0 and "hot.wait_for_save.calls" not in reduced


def test_calls_from_two_threads_are_counted_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM calls a connector from one thread per process; the recorder must not miscount if that changes
    (timed calls, errors and what calls meant; the sampling countdown is per operation, not per thread)."""
    import sys
    import threading

    from .connector_support import make_request

    monkeypatch.setattr(recorder_module, "MAX_PENDING_CALLS", 64)  # folds while the other thread appends
    recorder = PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, ["hot", "cold"])
    waits = {child: _timed(recorder, child, "wait_for_save", lambda: None) for child in ("hot", "cold")}
    loads = {child: _timed(recorder, child, "start_load_kv", _boom) for child in ("hot", "cold")}
    lookups = {child: _timed(recorder, child, "get_num_new_matched_tokens", lambda request, n: (16, False))
               for child in ("hot", "cold")}
    requests = {child: [make_request(f"{child}-{i}") for i in range(200)] for child in ("hot", "cold")}
    calls = 20_000

    def work(child: str) -> None:
        for i in range(calls):
            waits[child]()
            if i % 100 == 0:
                with pytest.raises(Failing) as failure:
                    loads[child](None)
                recorder.count_error(child, OPERATIONS["start_load_kv"], failure.value)
                request = requests[child][i // 100]
                answer = lookups[child](request, 0)
                recorder.request_admitted([answer], [("hot", "cold").index(child)], 0, 16)
                recorder.count_load_errors(child, i, {i})

    threads = [threading.Thread(target=work, args=(child,)) for child in ("hot", "cold")]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        for thread in threads:
            thread.start()
        tables = []
        while any(thread.is_alive() for thread in threads):
            tables.append(recorder.take())  # a third thread takes the stats meanwhile
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    tables.append(recorder.take())
    merged = CallTable(("hot", "cold"), len(DEFAULT_LATENCY_BUCKETS) + 1)
    for table in filter(None, tables):
        merged.add(table)
    for child in ("hot", "cold"):
        assert merged.call_count(child, "wait_for_save") == calls
        assert merged.call_count(child, "start_load_kv") == merged.errors[child]["start_load_kv"]["Failing"] == 200
        assert merged.call_count(child, "lookup") == 200
    # Each thread's lookups are its own child's; the other child was not asked about them.
    assert merged.counter("hot", "lookup_hits") == merged.counter("cold", "lookup_hits") == 200
    assert merged.counter("hot", "loaded_tokens") == 2 * 200 * 16  # child 0 is named the loader of every request
    assert merged.load_error_blocks("hot") == merged.load_error_blocks("cold") == 200
