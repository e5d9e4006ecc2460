"""Which experimental vLLM offloading APIs kvcompose's offloading spec relies on.

vLLM's out-of-tree offloading spec interface is experimental and has
changed shape before (an ``OffloadingHandler`` and
``vllm.v1.kv_offload.abstract`` preceded ``vllm.v1.kv_offload.base``). The
vLLM builds kvcompose tests against (0.30 to 0.32, ``make test-compat``) all
have the names below; an engine whose vLLM lacks any of them stops at start-up
with one line naming the vLLM version and what is missing, instead of an
``ImportError`` or an ``AttributeError`` mid-run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvcompose.adapters.contract import Contract, default_lookup, installed_vllm_version, missing_api
from kvcompose.adapters.contract import missing_names as missing_names  # for kvcompose.offload.spec

# Every vLLM name the spec relies on (a contract: see kvcompose.adapters.contract).
REQUIRED_OFFLOAD_API: Contract = {
    "vllm.v1.kv_offload.base.OffloadingWorker": ("submit_store", "submit_load", "get_finished", "wait", "shutdown"),
    "vllm.v1.kv_offload.base.TransferResult": ("job_id", "success", "transfer_size", "transfer_time"),
    "vllm.v1.kv_offload.base.GPULoadStoreSpec": ("block_ids", "group_sizes", "block_indices"),
    "vllm.v1.kv_offload.base.BlockIDsLoadStoreSpec": ("block_ids",),
    "vllm.v1.kv_offload.base.CanonicalKVCaches": ("tensors", "group_data_refs"),
    "vllm.v1.kv_offload.base.CanonicalKVCacheTensor": ("tensor", "page_size_bytes"),
    "vllm.v1.kv_offload.base.CanonicalKVCacheRef": ("tensor_idx", "page_size_bytes"),
    "vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec": ("get_manager", "get_worker", "build_metric_definitions"),
}

# Attributes a constructed CPUOffloadingSpec must carry (set in its __init__).
REQUIRED_SPEC_ATTRIBUTES: tuple[str, ...] = ("num_chunks", "blocks_per_chunk", "config", "extra_config")


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM lacks an offloading API kvcompose's spec needs."""


def missing_offload_api(lookup: Callable[[str], Any | None] = default_lookup) -> list[str]:
    """Every required name the vLLM seen through ``lookup`` lacks, in a stable order."""
    return missing_api(REQUIRED_OFFLOAD_API, lookup)


def unsupported_message(version: str, missing: Iterable[str]) -> str:
    """The one-line start-up error."""
    return (
        f"kvcompose.offload needs vLLM's offloading worker API (vLLM 0.30 to 0.32 have it); "
        f"vLLM {version} lacks {', '.join(missing)}"
    )


def require_offload_api(
    version: str | None = None, lookup: Callable[[str], Any | None] = default_lookup
) -> None:
    """Raise :class:`UnsupportedVLLMError` (one line) when a required API is missing."""
    missing = missing_offload_api(lookup)
    if missing:
        raise UnsupportedVLLMError(unsupported_message(version or installed_vllm_version(), missing))
