"""FaultInjectionConnector: a connector that fails on purpose, for rehearsing incidents.

It wraps any connector (``inner``, described like a pipeline child) and, with
seeded probabilities, raises :class:`~kvcompose.faults.InjectedFault` from
chosen operations, sleeps before them, or *lies*: a lookup reports the tokens
the inner connector has, the inner connector is never told to load them, and
the worker reports their blocks through ``get_block_ids_with_load_errors`` --
a store that has the data but whose transfer failed. vLLM fails the request
under its default ``kv_load_failure_policy: fail`` and recomputes the blocks
under ``recompute``. Point it at staging to see the alerts and dashboards fire.

A lie never claims more than the inner connector has: the step that skips a
load computes the rest of the prompt over blocks that hold no valid KV, and a
connector that saves that step (the inner one, on a miss) would store it.
Sibling children of a pipeline that save during that step do store it; keep
their stores out of real traffic while lies are on.

Lies apply to synchronous hits only (``None``, misses and asynchronous loads
pass through untouched) and need a model with one KV cache group: vLLM maps
failed block ids back to requests only then.

A fault raised in any operation leaves no state behind: what the injector
keeps per request or per step is taken out before the fault is drawn
(:meth:`FaultInjectionConnector.request_state_sizes` shows what is left).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvcompose.compat import check_name_lookups, supports_sleep_mode
from kvcompose.connectors.children import child_transfer_config
from kvcompose.faults import FaultInjectionConfig, FaultPlan, Faults, describe, fault_injection_config
from kvcompose.logs import get_logger
from kvcompose.wire.native import STATS_KEY, NativeStats, class_path

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = get_logger("fault_injection")


@dataclass
class FaultInjectionMetadata(KVConnectorMetadata):
    """The inner connector's metadata, plus the blocks the worker must report as not loaded."""

    inner: KVConnectorMetadata
    unloaded_block_ids: tuple[int, ...] = ()


class _Forwarded:
    """A method that calls the inner connector's method of the same name, preceded by the operation's
    planned faults if it has any."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: FaultInjectionConnector | None, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return instance.plan.wrap(self.name, getattr(instance.inner, self.name))


@dataclass(frozen=True)
class _Inner:
    config: FaultInjectionConfig
    connector_cls: type[KVConnectorBase_V1]
    vllm_config: VllmConfig


def _resolve_inner(vllm_config: VllmConfig) -> _Inner:
    own = vllm_config.kv_transfer_config
    assert own is not None, "a KV connector always has a kv_transfer_config"
    config = fault_injection_config(own.kv_connector_extra_config)
    connector_cls, transfer = _inner_class(config, own)
    inner_vllm_config = copy.copy(vllm_config)
    inner_vllm_config.kv_transfer_config = transfer
    return _Inner(config, connector_cls, inner_vllm_config)


def _inner_class(
    config: FaultInjectionConfig, own: KVTransferConfig | None
) -> tuple[type[KVConnectorBase_V1], KVTransferConfig]:
    """The inner connector's class and KVTransferConfig; its role defaults to the injector's own."""
    inner = config.inner
    # Without the injector's config (class-level hooks) any role will do: it does not pick the class.
    role = inner.role or (own.kv_role if own is not None else None) or "kv_both"
    transfer = child_transfer_config(inner, role, own)
    try:
        return KVConnectorFactory.get_connector_class(transfer), transfer
    except Exception as error:
        where = f" from {inner.module_path}" if inner.module_path else ""
        raise ValueError(
            f"FaultInjectionConnector: inner connector {inner.connector!r}{where} cannot be loaded: {error}"
        ) from error


class FaultInjectionConnector(KVConnectorBase_V1):
    """Wraps the connector named in its config and injects the configured faults."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        resolved = _resolve_inner(vllm_config)
        self.config = resolved.config
        check_name_lookups(self.config.inner, resolved.connector_cls)
        self._kv_cache_groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        if (refusal := self._refuse(self.config.faults)) is not None:
            raise ValueError(f"FaultInjectionConnector: {refusal}")
        self.plan = FaultPlan.of(self.config, self._refuse)
        self.inner = resolved.connector_cls(resolved.vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        # Scheduler side: request id -> tokens computed when its lookup lied, and
        # the blocks lies leave unloaded this step.
        self._lies: dict[str, int] = {}
        self._unloaded: list[int] = []
        # Worker side: blocks to report through get_block_ids_with_load_errors.
        self._load_errors: set[int] = set()
        logger.warning(
            "fault injection on", role=role.name.lower(), inner=resolved.connector_cls.__name__,
            seed=self.config.seed, faults_file=self.config.faults_file, **describe(self.plan.faults),
        )  # fmt: skip

    def _refuse(self, faults: Faults) -> str | None:
        """Why these faults cannot run on this model, if they cannot."""
        if faults.lie and self._kv_cache_groups > 1:
            return (
                "faults.lie needs a model with one KV cache group (vLLM cannot map failed block ids of several "
                "groups back to requests); set lie to 0"
            )
        return None

    def request_state_sizes(self) -> dict[str, int]:
        """Sizes of the per-request and per-step state that is not empty; none should outlive its request or step."""
        sizes = {"lies": len(self._lies), "lie_draws": self.plan.requests_drawn,
                 "unloaded_blocks": len(self._unloaded), "load_error_blocks": len(self._load_errors)}
        return {name: size for name, size in sizes.items() if size}

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.inner.supports_divergent_local_hybrid_hits

    @property
    def requires_kv_delivery(self) -> bool:
        return self.inner.requires_kv_delivery

    # ==============================
    # Forwarded as they are (after the operation's raise/latency faults)
    # ==============================

    # scheduler side
    get_external_cache_hit_sources = _Forwarded()
    get_loaded_kv_cache_group_ids = _Forwarded()
    on_new_request = _Forwarded()
    update_connector_output = _Forwarded()
    register_finished_partial_tail = _Forwarded()
    take_events = _Forwarded()
    has_pending_block_frees = _Forwarded()
    has_pending_push_work = _Forwarded()
    bind_kv_cache_manager = _Forwarded()
    bind_gpu_block_pool = _Forwarded()
    set_xfer_handshake_metadata = _Forwarded()
    set_xfer_handshake_metadata_pp_aware = _Forwarded()
    reset_cache = _Forwarded()
    # worker side
    register_kv_caches = _Forwarded()
    set_host_xfer_buffer_ops = _Forwarded()
    get_mem_pool_context = _Forwarded()
    start_load_kv = _Forwarded()
    wait_for_layer_load = _Forwarded()
    save_kv_layer = _Forwarded()
    wait_for_save = _Forwarded()
    finish_forward = _Forwarded()
    reset_capture_state = _Forwarded()
    get_finished = _Forwarded()
    get_transfer_results = _Forwarded()
    get_finished_count = _Forwarded()
    get_handshake_metadata = _Forwarded()
    build_connector_worker_meta = _Forwarded()
    get_kv_connector_kv_cache_events = _Forwarded()
    # both
    shutdown = _Forwarded()
    # sleep mode (vLLM 0.33+)
    unregister_kv_caches = _Forwarded()
    restore_kv_caches = _Forwarded()

    # ==============================
    # Lies: decided at lookup, sent to the worker, reported as load errors
    # ==============================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.plan.before("get_num_new_matched_tokens")
        matched, load_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        self._lies.pop(request.request_id, None)  # an earlier lookup's lie (one a fault left goes at alloc or finish)
        if matched and not load_async and self.plan.lies_about(request.request_id):
            self._lies[request.request_id] = num_computed_tokens
        return matched, load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """After a lie the inner connector hears of no load, as a child that was
        not chosen; the blocks it would have filled are this step's unloaded blocks."""
        computed = self._lies.pop(request.request_id, None)
        self.plan.before("update_state_after_alloc")
        if computed is None or num_external_tokens == 0:
            self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
            return
        self.inner.update_state_after_alloc(request, blocks, 0)
        first = computed // self._block_size
        end = -(-(computed + num_external_tokens) // self._block_size)
        self._unloaded.extend(blocks.get_block_ids()[0][first:end])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FaultInjectionMetadata:
        unloaded, self._unloaded = tuple(self._unloaded), []
        self.plan.before("build_connector_meta")
        return FaultInjectionMetadata(self.inner.build_connector_meta(scheduler_output), unloaded_block_ids=unloaded)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._lies.pop(request.request_id, None)
        self.plan.forget(request.request_id)
        self.plan.before("request_finished")
        return self.inner.request_finished(request, block_ids)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._load_errors = set()  # a step's blocks are that step's: never reported in a later one
        self.plan.before("bind_connector_metadata")
        assert isinstance(connector_metadata, FaultInjectionMetadata)
        self.inner.bind_connector_metadata(connector_metadata.inner)
        self._load_errors.update(connector_metadata.unloaded_block_ids)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self.plan.before("clear_connector_metadata")
        self.inner.clear_connector_metadata()
        super().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.plan.before("handle_preemptions")
        assert isinstance(kv_connector_metadata, FaultInjectionMetadata)
        self.inner.handle_preemptions(kv_connector_metadata.inner)

    def get_block_ids_with_load_errors(self) -> set[int]:
        unloaded, self._load_errors = self._load_errors, set()
        self.plan.before("get_block_ids_with_load_errors")
        return self.inner.get_block_ids_with_load_errors() | unloaded

    # ==============================
    # Stats and metrics: the inner connector's, tagged with its class
    # ==============================

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        self.plan.before("get_kv_connector_stats")
        stats = self.inner.get_kv_connector_stats()
        return None if stats is None else InnerConnectorStats(NativeStats(class_path(type(self.inner)), stats))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        native = NativeStats.from_payload(data) if data else None
        return None if native is None else InnerConnectorStats(native)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        inner = _resolve_inner(vllm_config)
        built = inner.connector_cls.build_prom_metrics(
            inner.vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
        if built is None:
            return None
        return _InnerPromMetrics(built, vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ==============================
    # Class-level hooks: the inner connector's class answers
    # ==============================

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        inner = _resolve_inner(vllm_config)
        return inner.connector_cls.get_required_kvcache_layout(inner.vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        config = fault_injection_config(extra_config)
        inner_cls, _ = _inner_class(config, None)
        return inner_cls.requires_piecewise_for_cudagraph(dict(config.inner.config))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        config = fault_injection_config(kv_transfer_config.kv_connector_extra_config)
        inner_cls, inner_transfer_config = _inner_class(config, kv_transfer_config)
        return supports_sleep_mode(inner_cls, inner_transfer_config)


class InnerConnectorStats(KVConnectorStats):
    """The inner connector's own stats and the class that rebuilds them in another process."""

    def __init__(self, native: NativeStats) -> None:
        super().__init__(data=native.to_dict())
        self.native = native

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        assert isinstance(other, InnerConnectorStats)
        self.native.add(other.native)
        return InnerConnectorStats(self.native)

    def reduce(self) -> dict[str, int | float]:
        return self.native.stats.reduce()

    def is_empty(self) -> bool:
        return self.native.stats.is_empty()

    def reset(self) -> None:
        self.native.stats.reset()
        self.data = self.native.to_dict()


class _InnerPromMetrics(KVConnectorPromMetrics):
    """The inner connector's Prometheus metrics, fed the inner part of each payload."""

    def __init__(
        self,
        inner: KVConnectorPromMetrics,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._inner = inner

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._inner.observe(transfer_stats_data[STATS_KEY], engine_idx)
