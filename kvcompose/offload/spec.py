"""``CPUEngineOffloadingSpec``: vLLM's CPU offloading, for engines that run on the CPU.

vLLM's ``CPUOffloadingSpec`` refuses CPU engines (its worker drives CUDA
streams). This subclass keeps everything else of it: the scheduler-side
``CPUOffloadingManager`` (lookups, LRU/ARC eviction, ``vllm:kv_offload_*``
metrics) and the chunk accounting from ``cpu_bytes_to_use``; only the worker
is replaced, by :class:`~kvcompose.offload.worker.ThreadedCopyWorker`.

Name it in an ``OffloadingConnector`` child's config::

    spec_name: CPUEngineOffloadingSpec
    spec_module_path: kvcompose.offload.spec
    cpu_bytes_to_use: 268435456          # host bytes for the whole engine (all workers)
    host_buffer_dir: /var/cache/kv       # optional: map the buffer onto unnamed files here

Importing this module checks the installed vLLM for every API the spec
uses and raises :class:`~kvcompose.offload.compat.UnsupportedVLLMError`
(one line) when one is missing.
"""

from __future__ import annotations

from pathlib import Path

from kvcompose.offload.compat import (
    REQUIRED_SPEC_ATTRIBUTES,
    UnsupportedVLLMError,
    installed_vllm_version,
    missing_names,
    require_offload_api,
    unsupported_message,
)

require_offload_api()  # before the imports below, which fail less clearly on an unsupported vLLM

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker  # noqa: E402
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402

from kvcompose.logs import get_logger  # noqa: E402
from kvcompose.offload.host_buffer import HostBuffer  # noqa: E402
from kvcompose.offload.worker import ThreadedCopyWorker  # noqa: E402

log = get_logger("offload")
HOST_BUFFER_DIR_KEY = "host_buffer_dir"


class CPUEngineOffloadingSpec(CPUOffloadingSpec):
    """CPU offloading for CPU engines; the host buffer may be file-backed (``host_buffer_dir``)."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        missing = missing_names(self, "CPUOffloadingSpec", REQUIRED_SPEC_ATTRIBUTES)
        if missing:
            raise UnsupportedVLLMError(unsupported_message(installed_vllm_version(), missing))
        if getattr(config, "canonical_layout", False):
            raise ValueError("CPUEngineOffloadingSpec copies whole blocks; remove canonical_layout from its config")
        if config.worker_kv_bytes_per_block > 0 and self.num_chunks < 1:
            raise ValueError(
                f"cpu_bytes_to_use={self.extra_config['cpu_bytes_to_use']} holds no offload chunk "
                f"({self.kv_bytes_per_chunk} bytes each); raise it"
            )
        self._copy_worker: ThreadedCopyWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._copy_worker is None:
            self._copy_worker = self._create_copy_worker(kv_caches)
        return self._copy_worker

    def host_buffer_directory(self) -> Path | None:
        """Where this worker's buffer file lives (``host_buffer_dir``), or None for a buffer in RAM."""
        directory = self.extra_config.get(HOST_BUFFER_DIR_KEY)
        return Path(directory) if directory else None

    def _create_copy_worker(self, kv_caches: CanonicalKVCaches) -> ThreadedCopyWorker:
        engine_tensors = [entry.tensor for entry in kv_caches.tensors]
        chunk_bytes = [tensor.shape[1] * self.blocks_per_chunk for tensor in engine_tensors]
        budget = int(self.extra_config["cpu_bytes_to_use"]) // max(self.config.parallel.world_size, 1)
        if self.num_chunks * sum(chunk_bytes) > budget:
            raise ValueError(
                f"{self.num_chunks} offload chunks of {sum(chunk_bytes)} bytes exceed this worker's share "
                f"({budget} bytes) of cpu_bytes_to_use"
            )
        host = HostBuffer(chunk_bytes, self.num_chunks, self.host_buffer_directory())
        log.info("offload host buffer", bytes=host.nbytes, chunks=self.num_chunks,
                 blocks_per_chunk=self.blocks_per_chunk, directory=str(host.directory) if host.directory else None)
        try:
            return ThreadedCopyWorker(engine_tensors, host, kv_caches.group_data_refs, self.blocks_per_chunk)
        except Exception:
            host.close()
            raise
