"""TEST-ONLY SHIM: lets stock LMCache store and load KV on vLLM's CPU engine, for `make test-lmcache`.

LMCache 0.5.6 has no CPU connector: its ``CreateGPUConnector`` factory knows
CUDA, XPU, MUSA and HPU only, so under vLLM's CPU backend LMCacheConnectorV1
starts but never caches. This module supplies the missing piece for the
optional LMCache test and nothing else: a connector that copies between
LMCache's chunks and vLLM's CPU KV cache, installed by replacing LMCache's
factory function when LMCache is first imported. It is not part of kvcompose;
the package itself never patches vLLM or LMCache.

Layouts: an LMCache chunk is ``[2, layers, tokens, kv_heads * head_size]``
(K then V). vLLM's CPU attention keeps one tensor per layer,
``[num_blocks, kv_heads, block_size, 2 * head_size]``, which it reads as
``[num_blocks, kv_heads, 2 * block_size, head_size]``: rows ``[0, block_size)``
are K, rows ``[block_size, 2 * block_size)`` are V. Token ``i`` of a request
lives at ``slot_mapping[i] = block * block_size + offset``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

FACTORY_MODULE = "lmcache.v1.gpu_connector"


class CPUCopyConnector:
    """The part of LMCache's ``GPUConnectorInterface`` its cache engine calls, by plain tensor copies."""

    def __init__(self, num_layers: int, hidden_dim: int) -> None:
        self.num_layers, self.hidden_dim = num_layers, hidden_dim

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Engine cache -> chunk (a store)."""
        blocks, offsets = _slots(kwargs["slot_mapping"][start:end], kwargs["kvcaches"][0])
        for layer, cache in enumerate(kwargs["kvcaches"]):
            rows = _rows(cache)
            block_size = cache.shape[2]
            memory_obj.tensor[0, layer] = rows[blocks, :, offsets, :].reshape(end - start, -1)
            memory_obj.tensor[1, layer] = rows[blocks, :, offsets + block_size, :].reshape(end - start, -1)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Chunk -> engine cache (a load), leaving the tokens vLLM already holds untouched."""
        skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
        blocks, offsets = _slots(kwargs["slot_mapping"][start + skip:end], kwargs["kvcaches"][0])
        for layer, cache in enumerate(kwargs["kvcaches"]):
            rows = _rows(cache)
            heads, head_size = rows.shape[1], rows.shape[3]
            keys = memory_obj.tensor[0, layer, skip:].reshape(-1, heads, head_size)
            values = memory_obj.tensor[1, layer, skip:].reshape(-1, heads, head_size)
            rows[blocks, :, offsets, :] = keys.to(rows.dtype)
            rows[blocks, :, offsets + cache.shape[2], :] = values.to(rows.dtype)

    def batched_from_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                         **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                       **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)


def _rows(cache: torch.Tensor) -> torch.Tensor:
    num_blocks, heads, block_size, _ = cache.shape
    return cache.view(num_blocks, heads, 2 * block_size, -1)


def _slots(slot_mapping: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    slots = slot_mapping.to(device="cpu", dtype=torch.long)
    return slots // cache.shape[2], slots % cache.shape[2]


def _install(factory_module: ModuleType) -> None:
    """Wrap LMCache's factory: vLLM on the CPU gets the copy connector, anything else LMCache's own."""
    from lmcache import torch_device_type
    from lmcache.utils import EngineType

    stock = factory_module.CreateGPUConnector

    def create(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        if engine == EngineType.VLLM and torch_device_type == "cpu":
            num_layers, _, _, heads, head_size = metadata.kv_shape
            return CPUCopyConnector(num_layers, heads * head_size)
        return stock(config, metadata, engine, layout_hints=layout_hints)

    factory_module.CreateGPUConnector = create


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Installs the shim the moment LMCache imports its factory module.

    LMCache must not be imported before vLLM's engine starts (its numba/llvmlite
    import breaks vLLM's triton dispatcher), so the shim waits for vLLM's own
    lazy import inside LMCacheConnectorV1.
    """

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != FACTORY_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        self._stock_loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._stock_loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._stock_loader.exec_module(module)
        _install(module)


def install_on_import() -> None:
    """Arrange for the shim to be installed when LMCache's factory module is imported (idempotent)."""
    if FACTORY_MODULE in sys.modules:
        _install(sys.modules[FACTORY_MODULE])
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
