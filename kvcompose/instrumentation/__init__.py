"""Metrics, tracing, transfer tracking and the watchdog around a composite, apart from its forwarding.

The composite (:mod:`kvcompose.connectors.composite`) forwards exactly as
vLLM's MultiConnector does. When its pipeline turns metrics or tracing on, it
holds an instrumentation of its role, made by :func:`instrument`, and

- makes each child call through the instrumentation's observed form of it
  (:meth:`~kvcompose.instrumentation.base.Instrumentation.observe`: timed, and
  traced under its request or step);
- tells it, through hooks at the places they happen, what only the composite
  knows: a request admitted or finished, a step bound or cleared, a save waited
  for, the children's transfer results and worker metadata.

Nothing is installed on the composite, and with metrics and tracing off there
is no instrumentation at all, but for ``receipts: true``: the scheduler side
then holds a :class:`~kvcompose.instrumentation.receipts.ReceiptInstrumentation`,
which keeps the receipts' books and times no call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcompose.instrumentation.base import engine_id_of
from kvcompose.instrumentation.economics import StreamSampler, fleet_sampling
from kvcompose.instrumentation.receipts import ReceiptInstrumentation, Receipts
from kvcompose.instrumentation.transfers import bytes_per_block
from kvcompose.instrumentation.scheduler import SchedulerInstrumentation
from kvcompose.instrumentation.worker import WorkerInstrumentation

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvcompose.child_spec import ChildSpec
    from kvcompose.config import Pipeline
    from kvcompose.instrumentation.transfers import GuardRecord

__all__ = ["SchedulerInstrumentation", "WorkerInstrumentation", "instrument"]


def instrument(
    pipeline: Pipeline, worker: bool, specs: list[ChildSpec], guards: Sequence[GuardRecord], loaders: tuple[int, ...],
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
) -> SchedulerInstrumentation | WorkerInstrumentation | ReceiptInstrumentation | None:
    """The instrumentation of a composite of this role (``worker``: the worker side; ``loaders``: the loading
    children's indices, in lookup order); None when the pipeline turns metrics and tracing off (and, on the
    scheduler side, receipts)."""
    observed = pipeline.metrics.enabled or pipeline.tracing.enabled
    if worker:
        return WorkerInstrumentation(pipeline, specs, guards, vllm_config, kv_cache_config) if observed else None
    # The receipts' books, and the router's predictions where they are exported (metrics on).
    receipts = (Receipts(specs, loaders, vllm_config.cache_config.block_size, pipeline.receipts,
                         pipeline.metrics.enabled) if pipeline.receipts or pipeline.metrics.enabled else None)
    if not observed:
        return None if receipts is None else ReceiptInstrumentation(pipeline, specs, receipts,
                                                                    engine_id_of(vllm_config))
    fleet_pipeline = pipeline if pipeline.metrics.enabled else None  # the fleet's samples go with the curve
    stream = stream_sampler(specs, loaders, vllm_config, kv_cache_config, fleet_pipeline)
    return SchedulerInstrumentation(pipeline, specs, loaders, engine_id_of(vllm_config), stream, receipts)


def stream_sampler(
    specs: list[ChildSpec], loaders: tuple[int, ...], vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
    pipeline: Pipeline | None = None,
) -> StreamSampler | None:
    """The scheduler's sampler of the prefix-block stream; None where the GPU cache's size is unknown (a composite
    made outside an engine). With prefix caching off the GPU cache serves no prefix hits: 0 blocks of it count.
    With ``pipeline`` (metrics on), the samples for the tiers its children share with other engines too."""
    gpu_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else vllm_config.cache_config.num_gpu_blocks
    if not gpu_blocks:
        return None
    block_bytes = bytes_per_block(kv_cache_config, vllm_config.parallel_config.tensor_parallel_size)
    prefix_cache_blocks = gpu_blocks if vllm_config.cache_config.enable_prefix_caching else 0
    fleet = (fleet_sampling(pipeline.fleet, specs, vllm_config, engine_id_of(vllm_config), block_bytes)
             if pipeline is not None else None)
    return StreamSampler(specs, loaders, prefix_cache_blocks, block_bytes, fleet)
