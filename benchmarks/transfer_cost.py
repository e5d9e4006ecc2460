"""Engine-thread cost of tracking one transfer, tracing off (metrics on) and tracing on.

A worker-side composite over no-op children runs steps whose metadata (built
beforehand) plans loads by the first child and marks new requests for saving
by every child, as vLLM orders the calls. The baseline is the same composite
as a worker that does not track transfers, as every worker of a tensor-parallel
engine but the first runs (the ledger, policies and metrics still run), so the
difference, per transfer, is what tracking costs the engine's thread. With
tracing on, each transfer is also one span record.
"""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

from benchmarks.connectors import kvcompose_connector, pipeline

REQUESTS_PER_STEP = 8


def step_metadata(children: int, step: int) -> Any:
    """A step's metadata: each request loaded by the first child and saved by every child, traced."""
    from kvcompose.wire.metadata import KVComposeMetadata, LoadPlan
    from kvcompose.wire.metadata import TracedRequest

    ids = [f"s{step}-r{index}" for index in range(REQUESTS_PER_STEP)]
    return KVComposeMetadata(
        per_child=(None,) * children, loads={req_id: LoadPlan(0, (1, 2), False) for req_id in ids},
        saves=dict.fromkeys(ids, 2), traced_requests=tuple(
            TracedRequest(req_id, step + 1, index + 1, True) for index, req_id in enumerate(ids)))


def run_steps(composite: Any, metadata: list[Any]) -> float:
    """CPU seconds of this thread for one step per metadata; the last step's stats carry the tables (as an
    engine's do once a second)."""
    metadata[-1].report_stats = True
    start = time.thread_time()
    for one_step in metadata:
        composite.bind_connector_metadata(one_step)
        composite.start_load_kv(None)
        composite.wait_for_layer_load("model.layers.0")
        composite.wait_for_save()
        composite.get_transfer_results(set())
        composite.clear_connector_metadata()
    composite.get_kv_connector_stats()
    return time.thread_time() - start


def measure(rounds: int = 5, steps: int = 400) -> dict[str, Any]:
    result = {}
    transfers_per_step = REQUESTS_PER_STEP * 3  # a load by one child, a save by each of two
    for name, tracing in (("tracing_off", None), ("tracing_on", "request")):
        tracked = kvcompose_connector(pipeline(2, tracing=tracing), "worker")
        with mock.patch("kvcompose.instrumentation.worker.is_first_worker", return_value=False):
            untracked = kvcompose_connector(pipeline(2, tracing=tracing), "worker")  # the baseline
        best = dict.fromkeys(("tracked", "untracked"), float("inf"))
        for _ in range(rounds):
            for subject, composite in (("tracked", tracked), ("untracked", untracked)):
                metadata = [step_metadata(len(composite.children), step) for step in range(steps)]
                best[subject] = min(best[subject], run_steps(composite, metadata))
        result[name] = (best["tracked"] - best["untracked"]) / (steps * transfers_per_step) * 1e6
    return {"us_per_transfer": result, "children": 2}


def table(result: dict[str, Any]) -> str:
    cost = result["us_per_transfer"]
    return ("| tracking | engine-thread us per transfer |\n| --- | --- |\n"
            f"| tracing off (metrics on) | {cost['tracing_off']:.2f} |\n| tracing on (a span each) | "
            f"{cost['tracing_on']:.2f} |")
