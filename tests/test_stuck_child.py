"""A child that hangs in a lookup, under the OpenAI server: seen while it hangs, and measured once it returns.

The first child is a FaultInjectionConnector over a disk tier reading its
faults from a file; one request is sent while the file makes every lookup
sleep 12 s. A Python call cannot be interrupted, so the request (and the
engine) waits; meanwhile the engine's watchdog logs the stuck call with the
child's stack, and the front-end's /metrics shows the child stuck
(``kvcompose_child_state`` 3) and how long its lookup has run
(``kvcompose_calls_in_progress_seconds``), though no stats flow. Afterwards the
latency histogram holds the call's real duration, and the tokens are a plain
engine's.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcompose.config import load_pipeline
from kvcompose.render import kv_transfer_config
from kvcompose.testing.tiny_model import prompt_words

from .engine_support import greedy
from .server_support import Server, start_server

pytestmark = pytest.mark.engine

HANG_S = 12.0
WATCHDOG_S = 2.0
PROMPT = prompt_words(seed=51, length=120)


@pytest.fixture(scope="module")
def stuck_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    root = tmp_path_factory.mktemp("stuck")
    faults = root / "faults.yaml"
    faults.write_text("")
    pipeline = {
        "version": 1, "name": "stuck", "watchdog_s": WATCHDOG_S,
        "children": [
            {"name": "slow", "connector": "FaultInjectionConnector", "module_path": "kvcompose.connectors",
             "config": {"seed": 1, "faults_file": str(faults), "inner": {
                 "connector": "ExampleConnector", "config": {"shared_storage_path": str(root / "slow")}}}},
            {"name": "disk", "connector": "ExampleConnector", "config": {"shared_storage_path": str(root / "disk")}},
        ],
    }
    config = kv_transfer_config(load_pipeline(pipeline), pipeline)
    server = start_server(tiny_model, json.dumps(config), root / "server.log")
    yield server, faults
    server.stop()


def _samples(metrics: str, name: str, **labels: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith(name + "{") and all(f'{key}="{value}"' in line for key, value in labels.items())]


def test_a_hung_lookup_is_seen_while_it_hangs_and_measured_when_it_returns(
    stuck_server: tuple[Server, Path], plain_llm: Any,
) -> None:
    server, faults = stuck_server
    expected = plain_llm.generate([PROMPT], greedy(), use_tqdm=False)[0].outputs[0].text
    faults.write_text(yaml.safe_dump({"latency": {"get_num_new_matched_tokens": {"probability": 1.0,
                                                                                  "seconds": HANG_S}}}))
    answers: list[Any] = []
    started = time.monotonic()
    request = threading.Thread(target=lambda: answers.append(server.complete(PROMPT)))
    request.start()

    # While the lookup sleeps, with no stats flowing: the live view shows it.
    seen: dict[str, float] = {}
    while time.monotonic() - started < HANG_S - 2 and "stuck" not in seen:
        time.sleep(0.5)
        metrics = server.metrics()
        states = _samples(metrics, "kvcompose_child_state", connector="slow")
        running = _samples(metrics, "kvcompose_calls_in_progress_seconds", connector="slow", op="lookup")
        if states and states[0] == 3 and running and running[0] >= WATCHDOG_S:
            seen = {"stuck": time.monotonic() - started, "running_s": running[0]}
    assert seen, server.log_tail()
    assert WATCHDOG_S <= seen["running_s"] <= seen["stuck"] + 0.5
    log = server.log.read_text(errors="replace")
    warning = next(line for line in log.splitlines() if "child call is running long" in line)
    assert "connector=slow" in warning and "op=lookup" in warning and "pipeline=stuck" in warning
    assert "child_stack=" in warning and "faults.py" in warning  # where the child sleeps

    faults.write_text("")
    request.join(60)
    assert answers and answers[0]["choices"][0]["text"] == expected

    # Afterwards: no longer stuck, and the call's real duration is in the latency histogram.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if _samples(metrics, "kvcompose_child_state", connector="slow") == [0.0]:
            break
        time.sleep(0.5)
    assert _samples(metrics, "kvcompose_child_state", connector="slow") == [0.0]
    assert _samples(metrics, "kvcompose_calls_in_progress_seconds", connector="slow", op="lookup") == [0.0]
    over_ten = (_samples(metrics, "kvcompose_call_duration_seconds_bucket", connector="slow", op="lookup",
                         le="+Inf")[0]
                - _samples(metrics, "kvcompose_call_duration_seconds_bucket", connector="slow", op="lookup",
                           le="10.0")[0])
    assert over_ten >= 1
    assert "child call returned after running long" in server.log.read_text(errors="replace")
