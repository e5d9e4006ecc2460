"""Which experimental vLLM offloading APIs kvcompose's offloading spec relies on.

vLLM's out-of-tree offloading spec interface is experimental and changed
shape between releases (0.30/0.31 had ``OffloadingHandler`` and
``vllm.v1.kv_offload.abstract``). An engine whose vLLM lacks any of the names
below stops at start-up with one line naming the vLLM version and what is
missing, instead of an ``ImportError`` or an ``AttributeError`` mid-run.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

# Dotted name of a vLLM object -> names it must have, as attributes or as
# parameters of its constructor (dataclass fields, ``__init__`` arguments).
REQUIRED_OFFLOAD_API: dict[str, tuple[str, ...]] = {
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


def default_lookup(dotted: str) -> Any | None:
    """Import the longest importable module prefix of ``dotted`` and walk the rest; None if absent."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            found = getattr(found, name, None)
            if found is None:
                return None
        return found
    return None


def _has(obj: Any, name: str) -> bool:
    if hasattr(obj, name):
        return True
    try:
        return name in inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False


def missing_names(obj: Any, dotted: str, names: Iterable[str]) -> list[str]:
    """``dotted.name`` for each of ``names`` that ``obj`` has neither as attribute nor as constructor parameter."""
    return [f"{dotted}.{name}" for name in names if not _has(obj, name)]


def missing_offload_api(lookup: Callable[[str], Any | None] = default_lookup) -> list[str]:
    """Every required name the vLLM seen through ``lookup`` lacks, in a stable order."""
    missing: list[str] = []
    for dotted, names in REQUIRED_OFFLOAD_API.items():
        obj = lookup(dotted)
        if obj is None:
            missing.append(dotted)
        else:
            missing.extend(missing_names(obj, dotted, names))
    return missing


def unsupported_message(version: str, missing: Iterable[str]) -> str:
    """The one-line start-up error."""
    return (
        f"kvcompose.offload needs vLLM's offloading worker API (vLLM 0.32 has it); "
        f"vLLM {version} lacks {', '.join(missing)}"
    )


def installed_vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def require_offload_api(
    version: str | None = None, lookup: Callable[[str], Any | None] = default_lookup
) -> None:
    """Raise :class:`UnsupportedVLLMError` (one line) when a required API is missing."""
    missing = missing_offload_api(lookup)
    if missing:
        raise UnsupportedVLLMError(unsupported_message(version or installed_vllm_version(), missing))
