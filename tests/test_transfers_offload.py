"""Transfers of vLLM's real OffloadingConnector (on kvcompose's CPU offloading spec), on a real in-process engine.

OffloadingConnector's transfers are its jobs, keyed by job id; kvcompose ends a request's load jobs with the
request's own events too (a load given back to vLLM), so none stays in flight until the expiry.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvcompose.offload import SPEC_MODULE, SPEC_NAME
from kvcompose.testing.tiny_model import prompt_words

from .engine_support import generate, in_process_connectors, in_process_llm

pytestmark = pytest.mark.engine


def _total(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return sum(sample.value for metric in REGISTRY.collect() for sample in metric.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def _offload_pipeline(name: str) -> dict[str, Any]:
    return {"version": 1, "name": name, "metrics": {"enabled": True}, "children": [
        {"name": "offload", "connector": "OffloadingConnector", "circuit_breaker": {"enabled": False},
         "config": {"spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE, "cpu_bytes_to_use": 4 << 20}},
    ]}


def test_a_load_job_given_back_to_vllm_ends_failed_and_leaves_nothing_in_flight(tiny_model: Path) -> None:
    """The offload child fails to start its load job (it raises in start_load_kv, so the job never runs):
    kvcompose gives the request's load back to vLLM, which recomputes, and the job's transfer ends failed then,
    not 600 s later."""
    with in_process_llm(tiny_model, _offload_pipeline("given-back")) as (llm, _):
        _, worker = in_process_connectors(llm)
        offload = worker.children[0].connector
        prompt = prompt_words(seed=71, length=300)
        baseline = generate(llm, [prompt])[0][0]  # a miss: stored

        start_kv_transfers = offload.connector_worker.start_kv_transfers

        def failing_loads(metadata: Any) -> None:
            if metadata.load_jobs:
                raise RuntimeError("injected: the offload worker cannot start its loads")
            start_kv_transfers(metadata)

        offload.connector_worker.start_kv_transfers = failing_loads
        failed_before = _total("kvcompose_transfers_failed_total", connector="offload", direction="load",
                               outcome="failed")
        assert generate(llm, [prompt])[0][0] == baseline  # recomputed
        time.sleep(1)  # the last stats reach the front-end

        assert "open_transfers" not in worker.request_state_sizes()
        assert _total("kvcompose_transfers_failed_total", connector="offload", direction="load",
                      outcome="failed") == failed_before + 1


def test_a_load_job_whose_request_vllm_finished_first_ends_aborted_when_the_job_completes() -> None:
    """The tracker driven by vLLM's own offloading metadata: the job of a request vLLM finished (aborted) while
    it loaded is keyed by its job id, not the request's; it ends aborted when the worker reports it done (the
    copy ran until then), and keeps its share of the measured copy time."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        OffloadingWorkerMetadata,
        TransferJob,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvcompose.config import load_pipeline
    from kvcompose.child_spec import ChildSpec
    from kvcompose.connectors.isolation import ChildGuard
    from kvcompose.wire.metadata import KVComposeMetadata
    from kvcompose.instrumentation.transfers import TransferTracker
    from kvcompose.metrics.transfers import TransferRecorder

    config = load_pipeline(_offload_pipeline("aborted")).children[0]
    recorder = TransferRecorder(True, ["offload"], (0.001, 1.0))
    tracker = TransferTracker([ChildSpec(0, config, OffloadingConnector, None)], [ChildGuard(config)], 1024,
                              recorder, None)
    job = TransferJob("r1", CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[0]))
    metadata = OffloadingConnectorMetadata(load_jobs={7: job}, store_jobs={})
    tracker.begin_step(KVComposeMetadata(per_child=(metadata,)), {})
    tracker.end_step()
    assert tracker.sizes() == {"open_transfers": 1}

    tracker.begin_step(KVComposeMetadata(per_child=(None,)), {})  # vLLM finished r1 before the step
    tracker.results(0, KVConnectorTransferResults(), {"r1"})
    done = OffloadingWorkerMetadata()
    done.mark_completed(7)
    done.transfer_stats.load.record(2048, 0.004)
    tracker.worker_meta(0, done)
    tracker.end_step()

    assert tracker.sizes() == {}
    table = recorder.take()
    assert table.failed("offload", "load", "aborted") == 1
    assert table.copy_seconds("offload", "load") == (1, 0.004)
    assert table.in_flight_change("offload", "load") == 0
