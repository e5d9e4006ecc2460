"""The live view: engine processes publish small JSON files, the front-end reads them into gauges, with real
processes on both sides (an engine stuck or idle sends no stats; these files keep its gauges true)."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose.live import PUBLISH_EVERY_S, LiveView, board, engine_ids, live_directory

from .span_support import wait_until

REPOSITORY = Path(__file__).resolve().parents[1]


class Engine:
    """A process publishing on its board (tests/live_engine.py)."""

    def __init__(self, engine_id: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "tests.live_engine", engine_id], cwd=REPOSITORY,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.path = live_directory() / f"kvcompose-live-{engine_id}-{self.process.pid}.json"

    def command(self, line: str) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline() == "ok\n"

    def values(self) -> dict[str, Any]:
        return json.loads(self.path.read_text())["values"]

    def exit(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(30)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)


@pytest.fixture
def engines() -> Iterator[Callable[[str], Engine]]:
    started: list[Engine] = []

    def start(engine_id: str) -> Engine:
        started.append(Engine(engine_id))
        return started[-1]

    yield start
    for engine in started:
        engine.kill()
        engine.path.unlink(missing_ok=True)


def test_a_board_publishes_changes_at_most_twice_a_second_only_when_changed_and_removes_its_file_at_exit(
    engines: Callable[[str], Engine],
) -> None:
    engine = engines(f"e-{uuid.uuid4()}")
    engine.command("set spans_queued 0")
    wait_until(lambda: engine.path.exists())
    contents, began = set(), time.monotonic()
    for value in range(40):  # 40 changes in 2 s
        engine.command(f"set spans_queued {value}")
        contents.add(engine.path.read_text())
        time.sleep(0.05)
    elapsed = time.monotonic() - began
    assert len(contents) <= elapsed / PUBLISH_EVERY_S + 2
    wait_until(lambda: engine.values() == {"spans_queued": 39}, timeout_s=2 * PUBLISH_EVERY_S + 1)

    written = engine.path.stat().st_mtime_ns
    for _ in range(4):  # the same value again: nothing is written
        engine.command("set spans_queued 39")
        time.sleep(PUBLISH_EVERY_S)
    assert engine.path.stat().st_mtime_ns == written

    engine.exit()
    assert not engine.path.exists()
    assert not list(live_directory().glob(f".{engine.path.name}*"))  # nor its temporary file


def test_files_of_killed_engines_are_removed_by_the_reader_and_by_the_next_engine(
    engines: Callable[[str], Engine],
) -> None:
    engine_id = f"e-{uuid.uuid4()}"
    killed = engines(engine_id)
    killed.command("set spans_queued 5")
    killed.command("publish")
    killed.kill()
    assert killed.path.exists()
    seen: list[Any] = []
    view = LiveView({0: engine_id})
    view.subscribe("spans_queued", lambda index, values: seen.append((index, values)))
    view.read()
    assert not killed.path.exists() and seen == [] and not view.publishing(0)

    other = engines(f"e-{uuid.uuid4()}")
    other.command("set spans_queued 1")
    other.command("publish")
    other.kill()
    assert other.path.exists()
    engines(engine_id).command("set spans_queued 0")  # the next engine to start a board clears it
    assert not other.path.exists()


def test_the_view_gives_each_subscriber_the_values_of_every_live_process_of_its_engines(
    engines: Callable[[str], Engine],
) -> None:
    engine_id, other_id = f"e-{uuid.uuid4()}", f"e-{uuid.uuid4()}"
    scheduler, worker, elsewhere = engines(engine_id), engines(engine_id), engines(other_id)
    for engine, value in ((scheduler, 3), (worker, 40), (elsewhere, 7)):
        engine.command(f"set spans_queued {value}")
        engine.command("publish")
    scheduler.command('set breakers {"hot": 1}')
    scheduler.command("publish")
    seen: dict[str, list[Any]] = {}
    view = LiveView({0: engine_id, 1: "absent"})
    view.subscribe("spans_queued", lambda index, values: seen.setdefault("queued", []).append((index, sorted(values))))
    view.subscribe("breakers", lambda index, values: seen.setdefault("breakers", []).append((index, values)))
    view.read()
    assert seen == {"queued": [(0, [3, 40])], "breakers": [(0, [{"hot": 1}])]}
    assert view.publishing(0) and not view.publishing(1)


def test_the_front_end_gauge_follows_the_engine_and_stays_true_without_stats(
    vllm_config_with: Callable, engines: Callable[[str], Engine],
) -> None:
    """KVComposePromMetrics (built by vLLM in the front-end) reads its engine's files on its own thread: the gauge
    follows the live value, and a stats report that comes later with an older value does not override it."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvcompose.connectors import KVComposeConnector
    from kvcompose.wire.stats import TELEMETRY_KEY

    engine_id = f"e-{uuid.uuid4()}"
    config = vllm_config_with({
        "kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
        "kv_role": "kv_both", "engine_id": engine_id,
        "kv_connector_extra_config": {"pipeline": {"version": 1, "name": "p", "children": [
            {"name": "hot", "connector": "ExampleConnector", "config": {"shared_storage_path": "/tmp/kvc-live"}}]}},
    })
    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    metrics = KVComposeConnector.build_prom_metrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})

    def queued() -> float | None:
        return registry.get_sample_value("kvcompose_spans_queued", {"model_name": "m", "engine": "0"})

    engine = engines(engine_id)
    engine.command("set spans_queued 40")
    wait_until(lambda: queued() == 40, timeout_s=5)
    metrics.observe({TELEMETRY_KEY: {"dropped": {}, "spans_queued": 12, "exporter_restarts": 0}}, 0)
    assert queued() == 40  # the engine is live: its file is fresher than any stats
    engine.command("set spans_queued 0")  # drained while no step runs: no stats would tell
    wait_until(lambda: queued() == 0, timeout_s=5)


@pytest.mark.parametrize(("data_parallel_size", "expected"), [
    (1, {0: "e"}), (2, {0: "e_dp0", 1: "e_dp1"}),
])
def test_engine_ids_follow_vllms_data_parallel_suffix(
    vllm_config_with: Callable, data_parallel_size: int, expected: dict[int, str],
) -> None:
    config = vllm_config_with({"kv_connector": "ExampleConnector", "kv_role": "kv_both", "engine_id": "e",
                               "kv_connector_extra_config": {}})
    config.parallel_config.data_parallel_size = data_parallel_size
    assert engine_ids(config, range(data_parallel_size)) == expected


def test_a_board_in_this_process_is_found_by_its_engine_id() -> None:
    engine_id = f"e-{uuid.uuid4()}"
    live = board(engine_id)
    assert board(engine_id) is live and live.path.name == f"kvcompose-live-{engine_id}-{os.getpid()}.json"
    live.set("spans_queued", 2)
    live.publish()
    try:
        assert json.loads(live.path.read_text()) == {"engine_id": engine_id, "pid": os.getpid(),
                                                     "values": {"spans_queued": 2}}
    finally:
        live.close()
    assert not live.path.exists()
