"""KVComposeConnector: vLLM's MultiConnector semantics over named children.

Load from one child (chosen by the pipeline's load policy; ``first_match`` is
MultiConnector's rule), save to every child with ``save: true``, and forward or
aggregate every other method of ``KVConnectorBase_V1`` the way MultiConnector
does. This module holds the forwarding logic only: every call into a child
goes through ``child.<operation>``, which observability wraps elsewhere. The
loops over children catch a data-path child's failure themselves and ask the
child's guard what it answers (see :mod:`kvcompose.connectors.isolation`).

Deliberately not forwarded:
- ``get_kv_connector_kv_cache_events``: MultiConnector does not aggregate it
  either (each child's event type differs); children's events still reach vLLM
  through ``take_events``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    CopyBlocksOp,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.outputs import KVConnectorOutput

from kvcompose.compat import supports_sleep_mode
from kvcompose.connectors.children import (
    Child,
    ChildSpec,
    child_classes,
    child_specs,
    construct_child,
    pipeline_from_extra_config,
    pipeline_from_vllm_config,
    resolved_children,
)
from kvcompose.connectors.isolation import BreakerState, ChildGuard
from kvcompose.connectors.ledger import SchedulerLedger, WorkerLedger
from kvcompose.connectors.metadata import KVComposeMetadata, KVComposeWorkerMetadata, LoadPlan
from kvcompose.connectors.pairing import PairingCheck, PipelineShape
from kvcompose.connectors.policies import POLICIES
from kvcompose.connectors.transfers import (
    TransferTracker,
    bytes_per_block,
    completion_mode,
    is_first_worker,
    job_requests,
)
from kvcompose.logs import configure_logging, get_logger
from kvcompose.metrics.native import NativeStats
from kvcompose.metrics.prometheus import KVComposePromMetrics
from kvcompose.metrics.recorder import DENSE_FROM_WORKERS, PipelineRecorder
from kvcompose.metrics.stats import BREAKERS_KEY, CALLS_KEY, NATIVE_KEY, TELEMETRY_KEY, TRANSFERS_KEY, KVComposeStats
from kvcompose.metrics.telemetry import TelemetryCounters
from kvcompose.metrics.transfers import TransferRecorder
from kvcompose.operations import FAILED, OPERATIONS
from kvcompose.tracing import pipeline_tracer

logger = get_logger("connector")

# The data-path operations, whose failures the loops below catch.
_LOOKUP, _AFTER_ALLOC = OPERATIONS["get_num_new_matched_tokens"], OPERATIONS["update_state_after_alloc"]
_START_LOAD, _WAIT_FOR_SAVE = OPERATIONS["start_load_kv"], OPERATIONS["wait_for_save"]
_TRANSFER_RESULTS, _LOAD_ERRORS = OPERATIONS["get_transfer_results"], OPERATIONS["get_block_ids_with_load_errors"]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.request import Request


class KVComposeConnector(KVConnectorBase_V1):
    """A KV connector made of the named children of a kvcompose pipeline."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.pipeline = pipeline_from_vllm_config(vllm_config)
        configure_logging(self.pipeline.logging)
        self._recorder = PipelineRecorder(
            self.pipeline.metrics.enabled,
            self.pipeline.metrics.latency_buckets,
            [child.name for child in self.pipeline.children],
            per_layer=self.pipeline.metrics.per_layer,
            ship_dense=role is KVConnectorRole.WORKER
            and vllm_config.parallel_config.world_size >= DENSE_FROM_WORKERS,
        )
        self._tracing = pipeline_tracer(self.pipeline, role.name.lower())
        self._guards = [ChildGuard(child, self._guard_changed, self._recorder.count_isolated_error)
                        for child in self.pipeline.children]
        for guard in self._guards:
            guard.half_open_at_step_start = role is KVConnectorRole.WORKER
        self.children = [
            Child(spec, construct_child(spec, role, kv_cache_config), self._guards[spec.index], self._wrap_child_call)
            for spec in child_specs(vllm_config, self.pipeline)
        ]
        self._loaders = tuple(c for c in self.children if c.load)
        self._savers = tuple(c for c in self.children if c.save)
        self._saves_stopped = False  # a load failed this step: no layer saves until it ends
        observed = self.pipeline.metrics.enabled or self.pipeline.tracing.enabled
        self._note_saves = observed and role is KVConnectorRole.SCHEDULER
        self._reports_span_telemetry = self.pipeline.metrics.enabled and self.pipeline.tracing.enabled
        # Scheduler side: children whose transfers are jobs in their metadata (their requests join the step's trace).
        self._job_children = [c.index for c in self.children if self.pipeline.tracing.enabled
                              and completion_mode(c.spec.connector_cls) == "jobs"]
        self._transfer_recorder = TransferRecorder(
            self.pipeline.metrics.enabled, [c.name for c in self.children], self.pipeline.metrics.transfer_buckets)
        self._transfers = TransferTracker(
            [c.spec for c in self.children], self._guards,
            bytes_per_block(kv_cache_config, vllm_config.parallel_config.tensor_parallel_size),
            self._transfer_recorder, self._tracing,
        ) if observed and role is KVConnectorRole.WORKER and is_first_worker() else None
        self._bind_layer_calls()
        self._choose_loader = POLICIES[self.pipeline.load.policy]
        self._check_hma(vllm_config)
        logger.info(
            "pipeline started", pipeline=self.pipeline.name, role=role.name.lower(),
            children=[f"{c.name}={c.spec.class_name}" for c in self.children],
            load_policy=self.pipeline.load.policy, metrics=self.pipeline.metrics.enabled,
            tracing=self.pipeline.tracing.granularity if self.pipeline.tracing.enabled else "off",
        )
        hma_enabled = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        shape = PipelineShape.of(self.pipeline.name, (c.spec for c in self.children), hma_enabled)
        self._pairing = PairingCheck(shape)  # a prefill/decode pair's pipelines must match
        self._scheduler_ledger = SchedulerLedger(vllm_config.cache_config.block_size)
        self._steps = 0  # scheduler side: metadata built so far
        self._worker_ledger = WorkerLedger()

    def _wrap_child_call(self, spec: ChildSpec, operation: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """How each child operation is made, decided at start-up and again when its breaker changes:
        timing innermost, then the breaker's gate, then the span, then isolation (off the data path).
        With nothing to add, the child's own bound method."""
        declared, guard = OPERATIONS[operation], self._guards[spec.index]
        gated = guard.gate(declared, self._recorder.wrap(spec.name, operation, call))
        return guard.isolating(declared, self._tracing.wrap(spec, operation, gated))

    def _guard_changed(self, guard: ChildGuard, state_changed: bool) -> None:
        self.children[self._guards.index(guard)].bind()
        self._bind_layer_calls()
        if state_changed:
            self._tracing.breaker_changed(guard.name, guard.state.name.lower())

    def _bind_layer_calls(self) -> None:
        """Bind the per-layer calls (made once per layer per step) once, not per
        call: only children whose circuit is closed; no saves for the rest of a
        step whose load failed."""
        closed = [c for c in self.children if c.guard.state is BreakerState.CLOSED]
        loads = {c.wait_for_layer_load: c for c in closed if c.load}
        saves = {c.save_kv_layer: c for c in closed if c.save and not self._saves_stopped}
        # A step with sync loads also marks their end after its last layer wait.
        transfers = self._transfers
        load_end = (transfers.layer_waited,) if transfers is not None and transfers.waits_for_loads else ()
        self._layer_loads, self._layer_saves = tuple(loads) + load_end, tuple(saves)
        self._layer_owners = {**loads, **saves}
        self._load_end_bound = bool(load_end)  # for this step only

    def _layer_call_failed(self, call: Callable[..., Any], operation: str, error: Exception) -> None:
        """A per-layer call raised: isolated (a failed load's blocks go back to vLLM), or raised again."""
        child = self._layer_owners[call]
        child.guard.answer(OPERATIONS[operation], error)
        if operation == "wait_for_layer_load":
            self._fail_loads(child.index)

    def _fail_loads(self, child_index: int) -> None:
        """The child failed this step: its loads go back to vLLM for recompute."""
        self._loads_failed(self._worker_ledger.fail_loads(child_index))

    def _loads_failed(self, plans: list[LoadPlan]) -> None:
        """A failed synchronous load means this step's forward reads blocks that
        were never filled: what it saves would poison the other tiers, so no
        child saves a layer until the step ends."""
        if not self._saves_stopped and any(not plan.load_async for plan in plans):
            self._saves_stopped = True
            self._layer_saves = ()
            if self._transfers is not None:
                self._transfers.saves_skipped()
            logger.warning("layer saves skipped for this step after a failed load",
                           connector=sorted({self.children[plan.child].name for plan in plans}))

    def request_state_sizes(self) -> dict[str, int]:
        """Sizes of the per-request maps that are not empty; none should outlive its requests."""
        sizes = {**self._scheduler_ledger.sizes(), **self._worker_ledger.sizes()}
        if self._transfers is not None:
            sizes.update(self._transfers.sizes())
        if self._recorder.open_lookups:
            sizes["lookup_answers"] = self._recorder.open_lookups
        if self._tracing.open_requests:
            sizes["traced_requests"] = self._tracing.open_requests
        return sizes

    def _check_hma(self, vllm_config: VllmConfig) -> None:
        hma_enabled = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        if hma_enabled and not all(supports_hma(c.connector) for c in self.children):
            plain = [c.name for c in self.children if not supports_hma(c.connector)]
            raise ValueError(
                f"kvcompose: the hybrid KV cache manager is enabled but children {plain} do not support it; "
                "run vLLM with --disable-hybrid-kv-cache-manager"
            )

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return all(c.connector.supports_divergent_local_hybrid_hits for c in self.children)

    @property
    def requires_kv_delivery(self) -> bool:
        return any(c.connector.requires_kv_delivery for c in self.children)

    # ==============================
    # Worker-side methods
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for child in self.children:
            child.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        for child in self.children:
            child.set_host_xfer_buffer_ops(copy_operation)

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        """At most one child may own the KV cache memory pool."""
        pools = [(c.name, ctx) for c in self.children if (ctx := c.get_mem_pool_context()) is not None]
        if len(pools) > 1:
            raise ValueError(
                f"kvcompose: children {[name for name, _ in pools]} each provide a KV cache memory pool; "
                "the KV cache lives in one pool, so configure a custom pool on one child only"
            )
        return pools[0][1] if pools else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, KVComposeMetadata)
        for guard in self._guards:
            guard.step_started()
        self._tracing.begin_step(connector_metadata.traced_requests, connector_metadata.loads)
        if (transfers := self._transfers) is not None:
            transfers.begin_step(connector_metadata)
            if transfers.waits_for_loads:
                self._bind_layer_calls()
        self._loads_failed(self._worker_ledger.begin_step(connector_metadata))
        for child, metadata in zip(self.children, connector_metadata.per_child, strict=True):
            if child.bind_connector_metadata(metadata) is FAILED:
                self._fail_loads(child.index)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        for child in self.children:
            child.clear_connector_metadata()
        super().clear_connector_metadata()
        self._worker_ledger.end_step()
        if self._transfers is not None:
            self._transfers.end_step()
        if self._saves_stopped or self._load_end_bound:  # back to every step's layer calls
            self._saves_stopped = False
            self._bind_layer_calls()
        self._tracing.end_step()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVComposeMetadata)
        for child, metadata in zip(self.children, kv_connector_metadata.per_child, strict=True):
            child.handle_preemptions(metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        for child in self._loaders:
            try:
                child.start_load_kv(forward_context, **kwargs)
            except Exception as error:
                child.guard.answer(_START_LOAD, error)
                self._fail_loads(child.index)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for wait_for_layer_load in self._layer_loads:
            try:
                wait_for_layer_load(layer_name)
            except Exception as error:
                self._layer_call_failed(wait_for_layer_load, "wait_for_layer_load", error)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        for save_kv_layer in self._layer_saves:
            try:
                save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
            except Exception as error:
                self._layer_call_failed(save_kv_layer, "save_kv_layer", error)

    def wait_for_save(self) -> None:
        for child in self._savers:
            try:
                child.wait_for_save()
            except Exception as error:
                child.guard.answer(_WAIT_FOR_SAVE, error)
        if self._transfers is not None:
            self._transfers.saves_waited()

    def finish_forward(self) -> None:
        for child in self.children:
            child.finish_forward()

    def reset_capture_state(self) -> None:
        for child in self.children:
            child.reset_capture_state()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Union of the children's results; a request counts as sent once its
        last async saver reports it. A child that failed gives up what it owes:
        its saves count as done, its receives as failed (vLLM recomputes)."""
        results = KVConnectorTransferResults()
        transfers = self._transfers
        for child in self.children:
            try:
                child_results = child.get_transfer_results(finished_req_ids)
            except Exception as error:
                child_results = child.guard.answer(_TRANSFER_RESULTS, error)
            if child_results is FAILED:
                child_results = self._worker_ledger.given_up(child.index)
                if transfers is not None:
                    transfers.results(child.index, None, finished_req_ids)
            elif transfers is not None:
                transfers.results(child.index, child_results, finished_req_ids)
            self._worker_ledger.settle(child.index, child_results, into=results)
        self._worker_ledger.take_failed_recvs(into=results)
        if transfers is not None:
            transfers.loads_given_back(results.failed_recving)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The children's failed blocks, plus those of loads kvcompose gave back
        for a failed child (counted for that child, by block id: see the recorder)."""
        step = self._connector_metadata.step if isinstance(self._connector_metadata, KVComposeMetadata) else -1
        failed: set[int] = set()
        for child in self.children:
            try:
                child_failed = child.get_block_ids_with_load_errors()
            except Exception as error:
                child_failed = child.guard.answer(_LOAD_ERRORS, error)
            if child_failed is FAILED:
                self._fail_loads(child.index)
            elif child_failed:
                failed |= child_failed
                self._recorder.count_load_errors(child.name, step, child_failed)
        load_errors, given_back = self._worker_ledger.take_load_errors()
        for index, blocks in given_back.items():
            self._recorder.count_load_errors(self.children[index].name, step, blocks)
        if self._transfers is not None:
            self._transfers.load_errors(failed | load_errors)
        return failed | load_errors

    def get_finished_count(self) -> int | None:
        counts = [child.get_finished_count() for child in self.children]
        if any(count is None for count in counts):
            return None
        distinct = set(counts)
        if len(distinct) > 1:
            raise ValueError(f"kvcompose: children report incompatible finished counts {sorted(distinct)}")
        return next(iter(distinct), None)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """The first child's handshake metadata that is not None."""
        for child in self.children:
            if (metadata := child.get_handshake_metadata()) is not None:
                return metadata
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        per_child = tuple(child.build_connector_worker_meta() for child in self.children)
        if self._transfers is not None:
            for index, metadata in enumerate(per_child):
                self._transfers.worker_meta(index, metadata)
        if all(metadata is None for metadata in per_child):
            return None
        return KVComposeWorkerMetadata(per_child=per_child)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """kvcompose's per-child call stats plus each child's own stats, since the last call."""
        calls = self._recorder.take()  # None, or a table of at least one call
        transfers = self._transfer_recorder.take() if self._transfers is not None else None  # only its tracker records
        telemetry = self._span_telemetry() if self._reports_span_telemetry else None
        breakers = {child.name: report for child, guard in zip(self.children, self._guards, strict=True)
                    if (report := guard.take_report()) is not None}
        native = {child.name: NativeStats(child.class_path, child_stats) for child in self.children
                  if (child_stats := child.get_kv_connector_stats()) is not None and not child_stats.is_empty()}
        if calls is None and transfers is None and telemetry is None and not breakers and not native:
            return None
        return KVComposeStats(data={CALLS_KEY: calls, TRANSFERS_KEY: transfers, TELEMETRY_KEY: telemetry,
                                    BREAKERS_KEY: breakers, NATIVE_KEY: native})

    def _span_telemetry(self) -> TelemetryCounters | None:
        """Spans this process dropped since the last report, and those waiting for export."""
        dropped, queued = self._tracing.telemetry()
        return TelemetryCounters(dropped, queued) if dropped or queued else None

    # ==============================
    # Scheduler-side methods
    # ==============================

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        for child in self.children:
            child.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        for child in self.children:
            child.bind_gpu_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.kv_transfer_params:  # a remote prefill's: check the pair's pipelines match
            self._pairing.check(request.kv_transfer_params)
        self._recorder.lookup_started(request.request_id)
        answers = []  # every loader is asked, as MultiConnector does, so each sees the request's lookup
        for child in self._loaders:
            try:
                answer = child.get_num_new_matched_tokens(request, num_computed_tokens)
            except Exception as error:
                answer = child.guard.answer(_LOOKUP, error)
            if answer[0] is None:  # still looking: the whole answer is "ask again later"
                return None, False
            answers.append(answer)
        chosen = self._choose_loader(answers)
        if chosen is None:
            self._scheduler_ledger.choose(request.request_id, None, num_computed_tokens, False)
            return 0, False
        tokens, load_async = answers[chosen]
        self._scheduler_ledger.choose(request.request_id, self._loaders[chosen].index, num_computed_tokens, load_async)
        return tokens, load_async

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        loader = self._scheduler_ledger.loader_of(request.request_id)
        if loader is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return self.children[loader].get_external_cache_hit_sources(request, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        loader = self._scheduler_ledger.loader_of(request.request_id)
        assert loader is not None, "vLLM asks only about requests a child loads"
        return self.children[loader].get_loaded_kv_cache_group_ids(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """The loading child gets the external token count; every other child
        gets the request's real blocks with 0 external tokens. The load is
        planned for the workers, or cancelled if the loading child failed."""
        loading = self._scheduler_ledger.loader_of(request.request_id) if num_external_tokens > 0 else None
        accepted = True
        for child in self.children:
            try:
                child.update_state_after_alloc(request, blocks, num_external_tokens if child.index == loading else 0)
            except Exception as error:
                child.guard.answer(_AFTER_ALLOC, error)
                accepted = accepted and child.index != loading
        if loading is not None:
            self._scheduler_ledger.plan_load(request.request_id, blocks, num_external_tokens, accepted)
        self._recorder.request_admitted(request, loading if accepted else None, num_external_tokens)

    def on_new_request(self, request: Request) -> None:
        for child in self.children:
            child.on_new_request(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVComposeMetadata:
        """Each child's metadata, and what the workers need to repair failures.
        A child that fails here sends none, and its planned loads are cancelled."""
        per_child = []
        for child in self.children:
            child_metadata = child.build_connector_meta(scheduler_output)
            if child_metadata is FAILED:
                child_metadata = None
                self._scheduler_ledger.cancel_loads_of(child.index)
            per_child.append(child_metadata)
        self._steps += 1
        metadata = KVComposeMetadata(per_child=tuple(per_child), step=self._steps)
        self._scheduler_ledger.fill(metadata)
        if self._note_saves:
            metadata.saves = {new.req_id: len(new.block_ids[0]) if new.block_ids else 0
                              for new in scheduler_output.scheduled_new_reqs} or None
        moving = job_requests(per_child[index] for index in self._job_children) if self._job_children else ()
        metadata.traced_requests = self._tracing.step_requests(scheduler_output, metadata.loads, moving)
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Each child sees its own worker metadata in ``kv_connector_worker_meta``."""
        composite_meta = connector_output.kv_connector_worker_meta
        assert composite_meta is None or isinstance(composite_meta, KVComposeWorkerMetadata)
        try:
            for child in self.children:
                if composite_meta is not None:
                    connector_output.kv_connector_worker_meta = composite_meta.per_child[child.index]
                child.update_connector_output(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = composite_meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finish_request(request, "request_finished", block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA variant of ``request_finished`` (only called when every child supports HMA)."""
        return self._finish_request(request, "request_finished_all_groups", block_ids)

    def _finish_request(
        self, request: Request, operation: str, block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Ask every child; merge their kv_transfer_params (a key clash is an
        error) and note its async savers so the request is reported sent once."""
        async_savers: list[int] = []
        params: dict[str, Any] | None = None
        try:
            for child in self.children:
                try:
                    saves_async, child_params = getattr(child, operation)(request, block_ids)
                except Exception as error:
                    saves_async, child_params = child.guard.answer(OPERATIONS[operation], error)
                if saves_async:
                    async_savers.append(child.index)
                if child_params is not None:
                    if params is None:
                        params = child_params
                    elif clashes := params.keys() & child_params.keys():
                        raise RuntimeError(
                            f"kvcompose: child {child.name!r} returns kv_transfer_params keys {sorted(clashes)} "
                            "that an earlier child already set"
                        )
                    else:
                        params.update(child_params)
        finally:
            self._scheduler_ledger.finished(request.request_id, async_savers)
            self._recorder.request_finished(request.request_id)
            self._tracing.request_finished(request, saves_async=bool(async_savers))
        return bool(async_savers), self._pairing.stamp(params)

    def register_finished_partial_tail(
        self, request: Request, block_ids: tuple[list[int], ...], partial_tail_offloads: list[tuple[int, int, int]]
    ) -> bool:
        accepted = [
            child.register_finished_partial_tail(request, block_ids, partial_tail_offloads) for child in self.children
        ]
        return any(accepted)

    def take_events(self) -> Iterable[KVCacheEvent]:
        for child in self.children:
            yield from child.take_events()

    def has_pending_block_frees(self) -> bool:
        return any(child.has_pending_block_frees() for child in self.children)

    def has_pending_push_work(self) -> bool:
        return any(child.has_pending_push_work() for child in self.children)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        for child in self.children:
            child.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        for child in self.children:
            child.set_xfer_handshake_metadata_pp_aware(metadata)

    def reset_cache(self) -> bool:
        results = [child.reset_cache() is not False for child in self.children]
        return all(results)

    def shutdown(self) -> None:
        """Close the tracer and shut every child down, whatever fails; then re-raise the last failure, if any."""
        if self._transfers is not None:
            self._transfers.close()
        tracer_failure: Exception | None = None
        try:
            self._tracing.close()
        except Exception as error:
            logger.error("tracer failed to close", error_type=type(error).__name__)
            tracer_failure = error
        self._call_every_child("shutdown", failure=tracer_failure)

    def _call_every_child(self, operation: str, failure: Exception | None = None) -> None:
        """Call ``operation`` on every child that has it, even after one fails; then
        re-raise the last failure (``failure``: one that happened before). A child's class
        from before vLLM added the operation has none: the base class's default did nothing."""
        for child in self.children:
            call = getattr(child, operation, None)
            if call is None:
                continue
            try:
                call()
            except Exception as error:
                logger.error("child call failed", connector=child.name, op=operation, error_type=type(error).__name__)
                failure = error
        if failure is not None:
            raise failure

    # ==============================
    # Sleep mode (vLLM 0.33+; older releases never call these)
    # ==============================

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """Only if every child's class does, as MultiConnector answers; vLLM refuses sleep mode otherwise."""
        pipeline = pipeline_from_extra_config(kv_transfer_config.kv_connector_extra_config)
        return all(
            supports_sleep_mode(child_cls, child_transfer_config)
            for child_cls, child_transfer_config in resolved_children(pipeline, kv_transfer_config)
        )

    def unregister_kv_caches(self) -> None:
        """Before sleep: every child drops its KV cache registrations (each is asked even if one fails)."""
        self._call_every_child("unregister_kv_caches")

    def restore_kv_caches(self) -> None:
        """After wake-up: every child registers again (each is asked even if one fails)."""
        self._call_every_child("restore_kv_caches")

    # ==============================
    # Class-level hooks (no instance; read the pipeline from the config)
    # ==============================

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        specs = child_specs(vllm_config, pipeline_from_vllm_config(vllm_config))
        layouts = {
            spec.name: layout
            for spec in specs
            if (layout := spec.connector_cls.get_required_kvcache_layout(spec.vllm_config)) is not None
        }
        if len(set(layouts.values())) > 1:
            raise ValueError(f"kvcompose: children need different KV cache layouts {layouts}; they must agree")
        return next(iter(layouts.values()), None)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        pipeline = pipeline_from_extra_config(extra_config)
        return any(
            child_cls.requires_piecewise_for_cudagraph(child.config)
            for child_cls, child in zip(child_classes(pipeline), pipeline.children, strict=True)
        )

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        pipeline = pipeline_from_vllm_config(vllm_config)
        if not pipeline.metrics.enabled:
            return None
        specs = child_specs(vllm_config, pipeline)
        return KVComposePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, pipeline, specs)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVComposeStats() if data is None else KVComposeStats.from_payload(data)


class KVComposeHMAConnector(KVComposeConnector, SupportsHMA):
    """KVComposeConnector for the hybrid KV cache manager (HMA).

    vLLM decides HMA support from the connector class, before any child
    exists; use this class name when every child supports HMA. Start-up
    fails with a clear message if one does not.
    """
