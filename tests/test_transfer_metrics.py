"""Per-transfer stats: the recorder, the mergeable TransferTable and TelemetryCounters, their Prometheus
series, and exemplars carried from a recorded trace id to a real Prometheus server's exemplar API.

That merging is associative, commutative and leaves its inputs alone is tested with every part of the
payload in test_stats.py."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings

from kvcompose.config import DEFAULT_TRANSFER_BUCKETS
from kvcompose.exposition import read
from kvcompose.metrics.transfers import TransferRecorder
from kvcompose.operations import DIRECTIONS
from kvcompose.wire.stats import TELEMETRY_KEY, TRANSFERS_KEY, KVComposeStats
from kvcompose.wire.telemetry import DROP_REASONS, TelemetryCounters
from kvcompose.wire.transfers import FAILURES, TransferTable

from .prometheus_support import api, wait
from .server_support import free_port
from .test_stats import leaves, payloads

BOUNDS = (0.001, 0.01, 0.1)
CHILDREN = ("hot", "cold", "remote")
TRACE_A, TRACE_B, TRACE_C = "0af7651916cd43dd8448eb211c80319c", "4bf92f3577b34da6a3ce929d0e0e4736", "1" * 32
PIPELINE = {"version": 1, "name": "xfer", "children": [
    {"name": name, "connector": "ExampleConnector", "config": {"shared_storage_path": f"/tmp/kvc-unused/{name}"}}
    for name in ("hot", "cold")
]}


# --- the recorder ------------------------------------------------------------------------------

def test_recorder_buckets_bytes_in_flight_failures_and_exemplars() -> None:
    recorder = TransferRecorder(True, CHILDREN, BOUNDS)
    assert recorder.take() is None
    for _ in range(3):
        recorder.started(0, "load")
    recorder.started(1, "save")
    recorder.ended(0, "load", 0.001, 0.0002, 100, "ok", TRACE_A)  # on a bound: that bound's bucket (le)
    recorder.ended(0, "load", 0.0005, None, 50, "ok", TRACE_B)  # same bucket, later: its exemplar now
    recorder.ended(0, "load", 5.0, None, 0, "failed", TRACE_C)  # beyond the last bound: +Inf
    recorder.ended(2, "save", 0.05, 0.05, 7, "aborted", None)  # no trace id: no exemplar
    recorder.waited(1, "save", 0.25)
    recorder.waited(1, "save", 0.5)

    table = recorder.take()
    assert table is not None and table.buckets == len(BOUNDS) + 1
    assert {table.at(cell // table.buckets) + (cell % table.buckets,): entry
            for cell, entry in table.cells.items()} == {
        ("hot", "load", 0): [2, 0.0015], ("hot", "load", 3): [1, 5.0], ("remote", "save", 2): [1, 0.05]}
    assert table.transfers("hot", "load") == 3 and table.transfers("cold", "save") == 0
    assert (table.bytes_moved("hot", "load"), table.bytes_moved("remote", "save")) == (150, 7)
    # Started less ended: 3 - 3, 1 - 0, 0 - 1 (the front-end adds the changes up).
    assert [table.in_flight_change(child, "load" if child == "hot" else "save") for child in CHILDREN] == [0, 1, -1]
    assert (table.failed("hot", "load", "failed"), table.failed("hot", "load", "aborted")) == (1, 0)
    assert table.failed("remote", "save", "aborted") == 1
    assert {cell: exemplar[1:] for cell, exemplar in table.exemplars.items()} == {
        0: [TRACE_B, 0.0005], 3: [TRACE_C, 5.0]}
    # Copy times, where known, in the copy cells; engine wait summed per lane.
    assert table.copy_seconds("hot", "load") == (1, 0.0002) and table.copy_seconds("remote", "save") == (1, 0.05)
    assert table.engine_wait("cold", "save") == 0.75 and table.engine_wait("hot", "load") == 0.0
    assert recorder.take() is None  # afresh

    recorder.started(1, "load")
    table = recorder.take()  # a start alone changes what is in flight
    assert table is not None and table.in_flight_change("cold", "load") == 1 and not table.cells


def test_recorder_off_records_nothing() -> None:
    recorder = TransferRecorder(False, CHILDREN, BOUNDS)
    recorder.started(0, "load")
    recorder.ended(0, "load", 0.5, 0.1, 10, "ok", TRACE_A)
    recorder.waited(0, "load", 0.1)
    assert recorder.take() is None


def test_transfers_ended_on_other_threads_are_all_counted() -> None:
    recorder = TransferRecorder(True, CHILDREN, BOUNDS)
    threads, per_thread, taken = 4, 5000, []
    done = threading.Event()

    def transfers(child: int) -> None:
        for _ in range(per_thread):
            recorder.started(child % 3, "save")
            recorder.ended(child % 3, "save", 0.002, 0.001, 1, "ok", None)

    def take_until_done() -> None:
        while not done.is_set():
            if (table := recorder.take()) is not None:
                taken.append(table)

    taker = threading.Thread(target=take_until_done)
    taker.start()
    workers = [threading.Thread(target=transfers, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    done.set()
    taker.join()
    total = TransferTable(CHILDREN, len(BOUNDS) + 1)
    for table in [*taken, recorder.take() or TransferTable(CHILDREN, len(BOUNDS) + 1)]:
        total.add(table)
    assert sum(total.transfers(child, "save") for child in CHILDREN) == threads * per_thread
    assert sum(total.moved_bytes) == threads * per_thread and not any(total.in_flight)


# --- merging and the process hop ---------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(payloads)
def test_payload_survives_vllms_msgpack_hop(payload: dict[str, Any]) -> None:
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    sent = KVComposeStats.from_payload(payload).to_dict()
    received = MsgpackDecoder().decode(MsgpackEncoder().encode(sent))
    assert KVComposeStats.from_payload(received).to_dict() == sent


def test_merged_exemplar_is_the_latest_of_its_bucket() -> None:
    def one_transfer(trace_id: str, at: float) -> KVComposeStats:
        return KVComposeStats(data={TRANSFERS_KEY: TransferTable(
            CHILDREN, 4, {0: [1, 0.0005]}, exemplars={0: [at, trace_id, 0.0005]})})

    for first, second in (((TRACE_A, 100.0), (TRACE_B, 200.0)), ((TRACE_B, 200.0), (TRACE_A, 100.0))):
        stats = one_transfer(*first).aggregate(one_transfer(*second))
        assert stats.transfers.exemplars == {0: [200.0, TRACE_B, 0.0005]} and stats.transfers.cells == {0: [2, 0.001]}


def test_empty_reduce_and_reset_account_for_transfers_and_telemetry() -> None:
    assert KVComposeStats(data={TRANSFERS_KEY: TransferTable(CHILDREN, 4)}).is_empty()
    assert KVComposeStats(data={TELEMETRY_KEY: TelemetryCounters()}).is_empty()
    assert not KVComposeStats(data={TELEMETRY_KEY: TelemetryCounters(spans_queued=0)}).is_empty()  # drained: 0
    recorder = TransferRecorder(True, CHILDREN, BOUNDS)
    recorder.started(0, "load")
    in_flight_only = KVComposeStats(data={TRANSFERS_KEY: recorder.take()})
    assert not in_flight_only.is_empty() and in_flight_only.reduce() == {}
    recorder.ended(0, "load", 0.004, None, 4096, "failed", None)
    recorder.ended(0, "load", 0.002, None, 4096, "ok", None)
    stats = KVComposeStats(data={TRANSFERS_KEY: recorder.take(),
                                 TELEMETRY_KEY: TelemetryCounters({"queue_full": 2}, 9)})
    assert stats.reduce() == {"hot.load.transfers": 2, "hot.load.mean_ms": 3.0, "hot.load.bytes": 8192,
                              "hot.load.failed": 1, "spans_dropped": 2, "spans_queued": 9}
    stats.reset()
    assert stats.is_empty() and stats.to_dict()[TRANSFERS_KEY] is None and stats.to_dict()[TELEMETRY_KEY] is None


def test_telemetry_adds_drops_by_reason_and_restarts_and_keeps_the_fullest_queue() -> None:
    total = TelemetryCounters({"queue_full": 3}, None)
    for report in (TelemetryCounters({"queue_full": 1, "exporter_down": 5}, 40, 1), TelemetryCounters({}, 7),
                   TelemetryCounters({"shutdown": 2}, None, 1)):
        total.add(report)
    assert (total.dropped, total.spans_queued, total.exporter_restarts) == (
        {"queue_full": 4, "exporter_down": 5, "shutdown": 2}, 40, 2)
    assert total.spans_dropped == 11


def test_tables_of_different_pipelines_or_versions_are_refused() -> None:
    with pytest.raises(ValueError, match="different pipelines"):
        TransferTable(("hot",), 4).add(TransferTable(("cold",), 4))
    with pytest.raises(ValueError, match="different pipelines"):
        TransferTable(("hot",), 4).add(TransferTable(("hot",), 5))
    payload = TransferTable(("hot",), 4).to_dict()
    payload["failure_outcomes"] = ["failed"]
    with pytest.raises(ValueError, match="one kvcompose version"):
        TransferTable.from_dict(payload)


def test_payload_size_is_bounded_whatever_the_traffic() -> None:
    def payload_after(transfers: int) -> dict[str, Any]:
        recorder = TransferRecorder(True, CHILDREN, DEFAULT_TRANSFER_BUCKETS)
        for i in range(transfers):
            child, direction = i % len(CHILDREN), DIRECTIONS[i % 2]
            recorder.started(child, direction)
            outcome = FAILURES[i % 2] if i % 5 == 0 else "ok"
            recorder.ended(child, direction, 10 ** (i % 7 - 5), 10 ** (i % 5 - 6), 4096, outcome,
                           f"{i:032x}")
        return KVComposeStats(data={TRANSFERS_KEY: recorder.take()}).to_dict()

    buckets = len(DEFAULT_TRANSFER_BUCKETS) + 1
    every_cell = range(len(CHILDREN) * len(DIRECTIONS) * buckets)
    full = TransferTable(CHILDREN, buckets, {cell: [1, 0.5] for cell in every_cell},
                         {cell: [1, 0.5] for cell in every_cell}, exemplars={cell: [1.0, TRACE_A, 0.5] for cell in every_cell})
    bound = leaves(KVComposeStats(data={TRANSFERS_KEY: full}).to_dict())
    for transfers in (300, 30_000):
        payload = payload_after(transfers)
        assert sum(payload[TRANSFERS_KEY]["cells"]["counts"]) == transfers and leaves(payload) <= bound


# --- Prometheus --------------------------------------------------------------------------------

def _prom_metrics(vllm_config_with: Callable, metric_types: dict[type, Any]) -> Any:
    from kvcompose.connectors import KVComposeConnector

    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": PIPELINE}})
    return KVComposeConnector.build_prom_metrics(config, metric_types, ["model_name", "engine"], {0: ["m", "0"]})


def _registry_and_types() -> tuple[Any, dict[type, Any]]:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()
    return registry, {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}


def _samples(registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], Any]:
    """(name, labels without model_name and engine) -> sample, from the OpenMetrics exposition."""
    from prometheus_client.openmetrics.exposition import generate_latest

    samples = {}
    for name, named in read(generate_latest(registry).decode()).samples.items():
        for sample in named:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine")))
            samples[(name, labels)] = sample
    return samples


def _lane(child: str, direction: str, **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"connector": child, "direction": direction, **extra}.items()))


def test_series_exist_at_zero_from_start_up(vllm_config_with: Callable) -> None:
    registry, metric_types = _registry_and_types()
    _prom_metrics(vllm_config_with, metric_types)
    samples = _samples(registry)
    for child in ("hot", "cold"):
        for direction in DIRECTIONS:
            lane = _lane(child, direction)
            assert samples[("kvcompose_transfer_lifetime_seconds_count", lane)].value == 0
            assert samples[("kvcompose_transfer_bytes_total", lane)].value == 0
            assert samples[("kvcompose_transfer_copy_seconds_count", _lane(child, direction, source="calls"))].value == 0
            assert samples[("kvcompose_transfer_copied_bytes_total", _lane(child, direction, source="calls"))].value == 0
            assert samples[("kvcompose_engine_wait_seconds_total", lane)].value == 0
            assert samples[("kvcompose_transfers_in_flight", lane)].value == 0
            for outcome in FAILURES:
                assert samples[("kvcompose_transfers_failed_total", _lane(child, direction, outcome=outcome))].value == 0
    for reason in DROP_REASONS:
        assert samples[("kvcompose_spans_dropped_total", (("reason", reason),))].value == 0
    assert samples[("kvcompose_spans_queued", ())].value == 0
    assert samples[("kvcompose_exporter_restarts_total", ())].value == 0


def test_stats_reach_every_series_exactly(vllm_config_with: Callable) -> None:
    from kvcompose.config import load_pipeline

    registry, metric_types = _registry_and_types()
    prom = _prom_metrics(vllm_config_with, metric_types)
    bounds = load_pipeline(PIPELINE).metrics.transfer_buckets
    recorder = TransferRecorder(True, ["hot", "cold"], bounds)
    for _ in range(3):
        recorder.started(0, "load")
    recorder.ended(0, "load", 0.003, 0.001, 1000, "ok", TRACE_A)
    recorder.ended(0, "load", 0.004, 0.002, 1000, "ok", None)
    recorder.ended(0, "load", 0.0041, None, 0, "aborted", TRACE_B)  # same bucket, later: the exemplar
    recorder.waited(0, "load", 0.25)
    recorder.started(1, "save")
    recorder.started(1, "save")
    recorder.ended(1, "save", 2.0, 0.5, 1 << 20, "ok", TRACE_C)
    prom.observe({TRANSFERS_KEY: recorder.take().to_dict(), TELEMETRY_KEY: {
        "dropped": {"queue_full": 5}, "spans_queued": 12, "exporter_restarts": 1}})
    recorder.ended(1, "save", 0.00001, None, 10, "failed", None)  # the next step: the rest of the save ends
    prom.observe({TRANSFERS_KEY: recorder.take().to_dict(), TELEMETRY_KEY: {
        "dropped": {"queue_full": 1, "exporter_down": 3}, "spans_queued": None, "exporter_restarts": 0}})

    samples = _samples(registry)
    hot_load, cold_save = _lane("hot", "load"), _lane("cold", "save")
    assert samples[("kvcompose_transfer_lifetime_seconds_count", hot_load)].value == 3
    assert samples[("kvcompose_transfer_lifetime_seconds_sum", hot_load)].value == pytest.approx(0.0111)
    assert samples[("kvcompose_transfer_lifetime_seconds_bucket", _lane("hot", "load", le="0.0025"))].value == 0
    five_ms = samples[("kvcompose_transfer_lifetime_seconds_bucket", _lane("hot", "load", le="0.005"))]
    assert five_ms.value == 3 and five_ms.exemplar.labels == {"trace_id": TRACE_B}
    assert five_ms.exemplar.value == 0.0041
    ten_us = samples[("kvcompose_transfer_lifetime_seconds_bucket", _lane("cold", "save", le="1e-05"))]
    assert ten_us.value == 1 and ten_us.exemplar is None  # on the bound: le; untraced
    assert samples[("kvcompose_transfer_lifetime_seconds_bucket", _lane("cold", "save", le="2.5"))].exemplar.labels \
        == {"trace_id": TRACE_C}
    # Copy times, labelled with their source (recording children: kvcompose's calls); engine wait.
    hot_load_copy = _lane("hot", "load", source="calls")
    assert samples[("kvcompose_transfer_copy_seconds_count", hot_load_copy)].value == 2
    assert samples[("kvcompose_transfer_copy_seconds_sum", hot_load_copy)].value == pytest.approx(0.003)
    assert samples[("kvcompose_transfer_copy_seconds_count", _lane("cold", "save", source="calls"))].value == 1
    assert samples[("kvcompose_engine_wait_seconds_total", hot_load)].value == 0.25
    assert samples[("kvcompose_engine_wait_seconds_total", cold_save)].value == 0
    assert samples[("kvcompose_transfer_bytes_total", hot_load)].value == 2000
    assert samples[("kvcompose_transfer_bytes_total", cold_save)].value == (1 << 20) + 10
    # Copied bytes: only the transfers with a copy time (the aborted load and the failed save have none).
    assert samples[("kvcompose_transfer_copied_bytes_total", hot_load_copy)].value == 2000
    assert samples[("kvcompose_transfer_copied_bytes_total", _lane("cold", "save", source="calls"))].value == 1 << 20
    assert samples[("kvcompose_transfers_in_flight", hot_load)].value == 0
    assert samples[("kvcompose_transfers_in_flight", cold_save)].value == 0  # +2 -1, then -1
    assert samples[("kvcompose_transfers_failed_total", _lane("hot", "load", outcome="aborted"))].value == 1
    assert samples[("kvcompose_transfers_failed_total", _lane("cold", "save", outcome="failed"))].value == 1
    assert samples[("kvcompose_spans_dropped_total", (("reason", "queue_full"),))].value == 6
    assert samples[("kvcompose_spans_dropped_total", (("reason", "exporter_down"),))].value == 3
    assert samples[("kvcompose_exporter_restarts_total", ())].value == 1
    assert samples[("kvcompose_spans_queued", ())].value == 12  # not reported the second time: unchanged


def test_a_cell_on_a_bound_stays_in_its_bucket() -> None:
    """Three calls of exactly 0.1 s sum to 0.30000000000000004 s; their mean lies above 0.1 s."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from kvcompose.metrics.histograms import replay_cell

    registry = CollectorRegistry()
    series = Histogram("replayed_seconds", "", buckets=BOUNDS, registry=registry)
    assert (0.1 + 0.1 + 0.1) / 3 > 0.1
    replay_cell(series, BOUNDS, 2, 3, 0.1 + 0.1 + 0.1)
    replay_cell(series, BOUNDS, 1, 2, 0.002, exemplar=(TRACE_A, 0.0015))  # the others' mean: 0.0005, below
    exposition = generate_latest(registry).decode()
    assert 'replayed_seconds_bucket{le="0.1"} 5.0' in exposition
    assert 'replayed_seconds_bucket{le="0.01"} 2.0' in exposition and 'replayed_seconds_bucket{le="0.001"} 0.0' in exposition


def test_in_flight_adds_up_across_api_server_processes(tmp_path: Path) -> None:
    """Two front-end processes in Prometheus multiprocess mode, one hearing of 3 starts, the other of 1 end:
    /metrics reads 2 in flight, in one series (no pid label)."""
    script = (
        "import sys\n"
        "from prometheus_client import Counter, Gauge, Histogram\n"
        "from kvcompose.config import DEFAULT_TRANSFER_BUCKETS as BOUNDS\n"
        "from kvcompose.metrics.transfer_series import TransferSeries\n"
        "from kvcompose.metrics.transfers import TransferRecorder\n"
        "metrics = TransferSeries({k: k for k in (Counter, Gauge, Histogram)}, ['model_name', 'engine', 'connector'],\n"
        "                         {0: ['m', '0']}, ['hot', 'cold'], [{'load': 'calls', 'save': 'calls'}] * 2,\n"
        "                         BOUNDS)\n"
        "recorder = TransferRecorder(True, ['hot', 'cold'], BOUNDS)\n"
        "for _ in range(int(sys.argv[1])):\n    recorder.started(0, 'load')\n"
        "for _ in range(int(sys.argv[2])):\n    recorder.ended(0, 'load', 0.01, None, 1, 'ok', None)\n"
        "metrics.observe(recorder.take(), 0)\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for started, ended in ((3, 0), (0, 1)):
        result = subprocess.run([sys.executable, "-c", script, str(started), str(ended)], env=env,
                                cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    in_flight = read(generate_latest(registry).decode()).series("kvcompose_transfers_in_flight", connector="hot",
                                                                direction="load")
    assert [(sample.value, "pid" in sample.labels) for sample in in_flight] == [(2.0, False)]


# --- exemplars through vLLM's /metrics and a real Prometheus ----------------------------------

@pytest.fixture
def vllm_metrics_app(vllm_config_with: Callable) -> Iterator[tuple[str, Any]]:
    """vLLM's front-end metrics (PrometheusStatLogger, the default registry) served by an app whose
    /metrics is mounted by vLLM's own ``attach_router``, as `vllm serve` does; (url, stat logger)."""
    import uvicorn
    from fastapi import FastAPI
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": PIPELINE}})
    stat_logger = PrometheusStatLogger(config)
    app = FastAPI()
    attach_router(app)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait(lambda: urllib.request.urlopen(f"{url}/metrics/", timeout=2).status == 200, 30, lambda: "no /metrics/")
    yield url, stat_logger
    server.should_exit = True
    thread.join(timeout=10)


def test_exemplars_reach_prometheus_from_vllms_metrics_endpoint(
    vllm_metrics_app: tuple[str, Any], tmp_path: Path,
) -> None:
    from kvcompose.config import load_pipeline

    from .prometheus_support import start_prometheus

    url, stat_logger = vllm_metrics_app
    recorder = TransferRecorder(True, ["hot", "cold"], load_pipeline(PIPELINE).metrics.transfer_buckets)
    recorded = {(0, "load", 0.003, TRACE_A), (1, "save", 1.7, TRACE_B)}
    for child, direction, seconds, trace_id in recorded:
        recorder.started(child, direction)
        recorder.ended(child, direction, seconds, seconds / 2, 4096, "ok", trace_id)
    stat_logger.kv_connector_prom.observe(KVComposeStats(data={TRANSFERS_KEY: recorder.take()}).to_dict(), 0)

    request = urllib.request.Request(f"{url}/metrics/", headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        assert f'# {{trace_id="{TRACE_A}"}} 0.003' in response.read().decode()

    prometheus = start_prometheus(url, tmp_path, metrics_path="/metrics/", features=("exemplar-storage",))
    try:
        def exemplars() -> set[tuple[str, str, str, str, float]]:
            now = time.time()
            found = api(prometheus.url, "query_exemplars", {
                "query": "kvcompose_transfer_lifetime_seconds_bucket", "start": now - 300, "end": now + 60})
            return {(series["seriesLabels"]["connector"], series["seriesLabels"]["direction"],
                     series["seriesLabels"]["le"], exemplar["labels"]["trace_id"], float(exemplar["value"]))
                    for series in found for exemplar in series["exemplars"]}

        # Each trace id on the bucket its transfer's duration fell in.
        expected = {("hot", "load", "0.005", TRACE_A, 0.003), ("cold", "save", "2.5", TRACE_B, 1.7)}
        wait(lambda: exemplars() == expected, 30, lambda: f"{exemplars()}\n{prometheus.log.read_text()}")
    finally:
        prometheus.stop()
