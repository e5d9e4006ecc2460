"""The connector adapters' contracts with vLLM, against the installed release's real classes.

Each adapter (``kvcompose.adapters``) names every vLLM class and field it
reads; here each name is checked against the installed vLLM, and the adapter
reads what vLLM's own code builds: a real OffloadingConnector (on kvcompose's
CPU offloading spec) running jobs, NIXL's stats class recording transfers. A
rename, or a value that changes meaning, fails here by name, where reads with
defaults used to lose copy times silently. ``make test-compat`` runs this file
on vLLM 0.30 and 0.31 too; :data:`OFFERS` says what each release offers.
"""

from __future__ import annotations

import ast
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvcompose.adapters import nixl, offloading
from kvcompose.adapters.completion import completion_mode, copy_source
from kvcompose.adapters.contract import default_lookup, missing_api
from kvcompose.offload import SPEC_MODULE, SPEC_NAME

from .test_compat import kvcompose_warnings  # noqa: F401  (a fixture)

ADAPTERS = (offloading, nixl)
NEUTRAL = {"kvcompose.operations", "kvcompose.config", "kvcompose.logs"}

# What each supported release offers the adapters: the copy sources of the connectors they read, and whether
# kvcompose's CPU offloading spec runs there. Every release from 0.30 has all of it (OffloadingWorkerMetadata's
# transfer_stats and NIXL's transfer_duration predate 0.30). A new release is one more row.
_ALL = {"OffloadingConnector": {"load": "child", "save": "child"},
        "NixlConnector": {"load": "child", "save": None},
        "NixlPullConnector": {"load": "child", "save": None},
        "NixlPushConnector": {"load": "child", "save": None},
        "ExampleConnector": {"load": "calls", "save": "calls"}}
OFFERS: dict[str, dict[str, dict[str, str | None]]] = {"0.30.0": _ALL, "0.31.0": _ALL, "0.32.0": _ALL}


def _installed() -> str:
    import vllm

    return vllm.__version__


def _connector_class(name: str) -> type:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector=name, kv_role="kv_both"))


# ---- the contracts ----


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda adapter: adapter.__name__.rpartition(".")[2])
def test_the_installed_vllm_has_every_name_the_adapter_reads(adapter: Any) -> None:
    assert _installed() in OFFERS, "a release kvcompose does not list: add what it offers to OFFERS"
    assert missing_api(adapter.CONTRACT) == []
    assert adapter.unmet() == ()


def test_each_connector_is_told_by_the_class_vllm_resolves_its_name_to() -> None:
    """vLLM's factory resolves NixlConnector to NixlPullConnector, a subclass of the NIXL adapter's class."""
    offers = OFFERS[_installed()]
    modes = {name: completion_mode(_connector_class(name)) for name in offers}
    assert modes == {"OffloadingConnector": "jobs", "NixlConnector": "finish", "NixlPullConnector": "finish",
                     "NixlPushConnector": "finish", "ExampleConnector": "sync"}
    assert {name: copy_source(_connector_class(name)) for name in offers} == offers
    read_by = {"OffloadingConnector": offloading, "NixlConnector": nixl, "NixlPullConnector": nixl,
               "NixlPushConnector": nixl}
    for name, adapter in read_by.items():
        assert issubclass(_connector_class(name), default_lookup(adapter.CONNECTOR))


def test_a_missing_name_is_named_by_its_dotted_path() -> None:
    """What an adapter would warn about on a vLLM that renamed a field: here TransferStats.store."""

    @dataclass
    class TransferStatsWithoutStore:
        load: Any = None

    renamed = f"{offloading._COMMON}.TransferStats"
    lookup = {dotted: default_lookup(dotted) for dotted in offloading.CONTRACT} | {renamed: TransferStatsWithoutStore}
    assert missing_api(offloading.CONTRACT, lookup.get) == [f"{renamed}.store"]
    assert missing_api({"vllm.no_such_module.Class": ("field",)}) == ["vllm.no_such_module.Class"]


@pytest.fixture
def broken_offloading_contract(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The offloading adapter as on a vLLM that broke its contract (kvcompose's own check answers so)."""
    monkeypatch.setattr(offloading, "unmet", lambda: ("vllm.somewhere.Renamed",))
    offloading._read.cache_clear()
    yield
    offloading._read.cache_clear()


def test_an_adapter_whose_contract_is_broken_reads_nothing_and_claims_no_copy_times(
        broken_offloading_contract: None, kvcompose_warnings: list[str]) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    done = OffloadingWorkerMetadata()
    done.mark_completed(3)
    done.transfer_stats.load.record(1024, 0.5)
    assert list(offloading.jobs(_metadata(load_jobs={3: _job("r1", "load", [1])}))) == []
    assert offloading.completed_jobs(done) == []
    assert offloading.copy_seconds(done, "load") is None
    assert copy_source(_connector_class("OffloadingConnector")) == {"load": None, "save": None}

    from kvcompose.adapters.contract import unmet

    assert unmet("OffloadingConnector", ["vllm.somewhere.Renamed.field"]) == ("vllm.somewhere.Renamed.field",)
    assert len(kvcompose_warnings) == 1
    assert "OffloadingConnector" in kvcompose_warnings[0] and "vllm.somewhere.Renamed.field" in kvcompose_warnings[0]


def test_the_adapters_import_no_other_kvcompose_subpackage() -> None:
    """Instrumentation and metrics import the adapters, never the other way round."""
    package = Path(offloading.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvcompose"):
                assert node.module.startswith("kvcompose.adapters") or node.module in NEUTRAL, (path.name, node.module)


# ---- OffloadingConnector ----


def _metadata(load_jobs: dict[int, Any] | None = None, store_jobs: dict[int, Any] | None = None) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata

    return OffloadingConnectorMetadata(load_jobs=load_jobs or {}, store_jobs=store_jobs or {})


def _job(req_id: str, direction: str, engine_blocks: list[int], chunks: list[int] | None = None) -> Any:
    """A TransferJob between the engine's ``engine_blocks`` and host ``chunks`` (as many, by default)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    engine = GPULoadStoreSpec(engine_blocks, group_sizes=[len(engine_blocks)], block_indices=[0])
    host = CPULoadStoreSpec(chunks if chunks is not None else list(range(len(engine_blocks))))
    return TransferJob(req_id, host, engine) if direction == "load" else TransferJob(req_id, engine, host)


def test_offloading_jobs_are_read_with_their_request_and_engine_blocks() -> None:
    metadata = _metadata(load_jobs={4: _job("r1", "load", [7, 8, 9], [0])},
                         store_jobs={5: _job("r2", "save", [1, 2]), 6: _job("r1", "save", [3])})
    assert list(offloading.jobs(metadata)) == [
        ("load", "4", "r1", 3), ("save", "5", "r2", 2), ("save", "6", "r1", 1)]
    assert offloading.job_requests([metadata, None, _metadata()]) == {"r1", "r2"}
    assert list(offloading.jobs(None)) == []  # a child that sent no metadata this step


def test_offloading_worker_metadata_is_read_as_vllms_workers_record_it() -> None:
    """OffloadingConnectorWorker marks each finished job completed and records its bytes and seconds per
    direction; the adapter reads those seconds back."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    done = OffloadingWorkerMetadata()
    for job_id, direction, nbytes, seconds in ((7, "load", 2048, 0.004), (8, "store", 4096, 0.002),
                                               (9, "store", 4096, 0.003)):
        done.mark_completed(job_id)
        getattr(done.transfer_stats, direction).record(nbytes, seconds)
    assert offloading.completed_jobs(done) == ["7", "8", "9"]
    assert offloading.copy_seconds(done, "load") == pytest.approx(0.004)
    assert offloading.copy_seconds(done, "save") == pytest.approx(0.005)
    assert offloading.completed_jobs(None) == [] and offloading.copy_seconds(None, "load") is None


BLOCK_TOKENS, HEADS, HEAD_SIZE, BLOCKS = 128, 2, 8, 6


@pytest.fixture
def offloading_worker(vllm_config_with: Callable[[dict[str, Any]], Any]) -> Iterator[Any]:
    """vLLM's OffloadingConnector, worker side, on kvcompose's CPU spec, over a one-layer KV cache of real
    tensors, built as the engine builds it, without an engine."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    config = vllm_config_with({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE,
                                                             "cpu_bytes_to_use": 1 << 20}})
    spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    connector = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    connector.register_kv_caches({"layer": torch.zeros(BLOCKS, 2, BLOCK_TOKENS, HEADS, HEAD_SIZE)})
    yield connector
    connector.shutdown()


def _steps_until_done(connector: Any, metadata: Any) -> list[Any]:
    """Engine steps, the first with ``metadata``, until the connector's worker metadata has completed a job:
    the worker metadata of each step that had one."""
    reported = []
    for step in range(200):
        connector.bind_connector_metadata(metadata if step == 0 else _metadata())
        connector.start_load_kv(None)  # (OffloadingConnector does not read the forward context)
        connector.wait_for_save()
        connector.get_finished(set())
        if (worker_meta := connector.build_connector_worker_meta()) is not None:
            reported.append(worker_meta)
        connector.clear_connector_metadata()
        if reported:
            return reported
        time.sleep(0.01)
    raise AssertionError("no job completed in 200 steps")


def test_a_real_offloading_connector_reports_its_jobs_and_their_copy_times(offloading_worker: Any) -> None:
    store = _metadata(store_jobs={11: _job("r1", "save", [1, 2], [0, 1])})
    assert list(offloading.jobs(store)) == [("save", "11", "r1", 2)]
    (stored,) = _steps_until_done(offloading_worker, store)
    assert offloading.completed_jobs(stored) == ["11"]
    assert offloading.copy_seconds(stored, "save") > 0 and offloading.copy_seconds(stored, "load") == 0

    load = _metadata(load_jobs={12: _job("r2", "load", [4, 5], [0, 1])})
    (loaded,) = _steps_until_done(offloading_worker, load)
    assert offloading.completed_jobs(loaded) == ["12"]
    assert offloading.copy_seconds(loaded, "load") > 0 and offloading.copy_seconds(loaded, "save") == 0


# ---- NIXL ----


@dataclass
class _Telemetry:
    """NIXL's per-transfer telemetry (nixlXferTelemetry, whose fields cannot be set): microseconds, bytes."""

    xferDuration: int
    postDuration: int
    totalBytes: int
    descCount: int


def test_nixl_copy_times_are_read_from_its_transfer_telemetry_in_seconds() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    stats = NixlKVConnectorStats()
    assert nixl.copy_seconds(stats) is None  # no transfer yet
    stats.record_transfer(_Telemetry(xferDuration=2500, postDuration=100, totalBytes=1 << 20, descCount=4))
    stats.record_transfer(_Telemetry(xferDuration=1500, postDuration=100, totalBytes=1 << 20, descCount=4))
    stats.record_failed_transfer()
    step = stats.clone_and_reset()  # what the worker's get_kv_connector_stats hands over
    assert nixl.copy_seconds(step) == pytest.approx(0.004)
    assert nixl.copy_seconds(stats) is None
    assert nixl.copy_seconds(KVConnectorStats(data={nixl.TRANSFER_DURATION: [1.0]})) is None  # not NIXL's stats
