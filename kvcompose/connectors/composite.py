"""KVComposeConnector: vLLM's MultiConnector semantics over named children.

Load from one child (chosen by the pipeline's load policy; ``first_match`` is
MultiConnector's rule), save to every child with ``save: true``, and forward or
aggregate every other method of ``KVConnectorBase_V1`` the way MultiConnector
does. Each loop iterates the operation's fixed tuple of calls
(``self._calls.<operation>``, built once: see :mod:`kvcompose.connectors.calls`),
catches a child's failure itself and asks the child's guard what it answers
(see :mod:`kvcompose.connectors.isolation`).

When the pipeline turns metrics or tracing on, the composite holds an
instrumentation of its role (:mod:`kvcompose.instrumentation`): every call in
the tuples goes through its observed form (timed, traced), and the composite
tells it what happens where it happens (a request admitted, a step bound, a
save waited for). Those hooks are the lines that start with
``if self._instrumentation is not None``.

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
from kvcompose.connectors.calls import ChildCalls
from kvcompose.connectors.children import (
    Child,
    child_classes,
    child_specs,
    construct_child,
    pipeline_from_extra_config,
    pipeline_from_vllm_config,
    resolved_children,
)
from kvcompose.connectors.deferrals import Deferrals, LookupDeferredTooLong
from kvcompose.connectors.isolation import ChildGuard
from kvcompose.connectors.ledger import SchedulerLedger, WorkerLedger
from kvcompose.connectors.pairing import PairingCheck, PipelineShape
from kvcompose.connectors.policies import POLICIES
from kvcompose.connectors.watchdog import watchdog
from kvcompose.instrumentation import SchedulerInstrumentation, WorkerInstrumentation, instrument
from kvcompose.instrumentation.receipts import ReceiptInstrumentation, with_receipt
from kvcompose.logs import configure_logging, get_logger
from kvcompose.metrics.prometheus import KVComposePromMetrics
from kvcompose.operations import FAILED, OPERATIONS, Operation
from kvcompose.wire.metadata import KVComposeMetadata, KVComposeWorkerMetadata, LoadPlan
from kvcompose.wire.native import NativeStats
from kvcompose.wire.stats import BREAKERS_KEY, NATIVE_KEY, KVComposeStats

logger = get_logger("connector")

# The operations whose failures the composite's loops catch (each child's guard answers for it).
_LOOKUP = OPERATIONS["get_num_new_matched_tokens"]
_AFTER_ALLOC = OPERATIONS["update_state_after_alloc"]
_BIND = OPERATIONS["bind_connector_metadata"]
_START_LOAD = OPERATIONS["start_load_kv"]
_WAIT_FOR_SAVE = OPERATIONS["wait_for_save"]
_LAYER_LOAD = OPERATIONS["wait_for_layer_load"]
_LAYER_SAVE = OPERATIONS["save_kv_layer"]
_TRANSFER_RESULTS = OPERATIONS["get_transfer_results"]
_LOAD_ERRORS = OPERATIONS["get_block_ids_with_load_errors"]
_FINISHED = OPERATIONS["request_finished"]
_FINISHED_ALL_GROUPS = OPERATIONS["request_finished_all_groups"]
_CLEAR = OPERATIONS["clear_connector_metadata"]
_PREEMPTIONS = OPERATIONS["handle_preemptions"]
_FINISH_FORWARD = OPERATIONS["finish_forward"]
_WORKER_META = OPERATIONS["build_connector_worker_meta"]
_STATS = OPERATIONS["get_kv_connector_stats"]
_HIT_SOURCES = OPERATIONS["get_external_cache_hit_sources"]
_NEW_REQUEST = OPERATIONS["on_new_request"]
_BUILD_META = OPERATIONS["build_connector_meta"]
_OUTPUT = OPERATIONS["update_connector_output"]
_FREES = OPERATIONS["has_pending_block_frees"]
_PUSH = OPERATIONS["has_pending_push_work"]
_RESET = OPERATIONS["reset_cache"]
# Never isolated: every child is asked, then the last failure raised.
_SHUTDOWN = OPERATIONS["shutdown"]
_UNREGISTER = OPERATIONS["unregister_kv_caches"]
_RESTORE = OPERATIONS["restore_kv_caches"]
_NO_MATCH = (0, False)

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
        worker = role is KVConnectorRole.WORKER
        specs = child_specs(vllm_config, self.pipeline)
        self._guards = [ChildGuard(child, self._guard_changed, self._child_failed) for child in self.pipeline.children]
        for guard in self._guards:
            guard.half_open_at_step_start = worker
        self._open_guards: list[ChildGuard] = []  # those whose circuit is not closed
        self._breakers_changed = False  # a circuit changed state since the last stats
        # The children's indices, in the order they answer lookups.
        self._loaders = tuple(spec.index for spec in specs if spec.config.load)
        self._scheduler_ledger = SchedulerLedger(vllm_config.cache_config.block_size, self._loaders)
        self._worker_ledger = WorkerLedger()
        self._deferrals = Deferrals(self.pipeline.watchdog_s)  # lookups answered "ask again later"
        # None when the pipeline turns metrics and tracing off (and receipts: see kvcompose.instrumentation.receipts):
        # then nothing but forwarding runs.
        self._instrumentation: SchedulerInstrumentation | WorkerInstrumentation | ReceiptInstrumentation | None
        self._instrumentation = instrument(
            self.pipeline, worker, specs, self._guards, self._loaders, vllm_config, kv_cache_config)
        self.children = [Child(spec, construct_child(spec, role, kv_cache_config), self._guards[spec.index])
                         for spec in specs]
        self._child_calls = ChildCalls(
            self.children, self._instrumentation.observe if self._instrumentation is not None else None)
        self._calls = self._child_calls.fanout  # per operation, the calls its loop makes
        # first_match, MultiConnector's rule, is decided as the loaders answer; another policy reads every answer.
        policy = self.pipeline.load.policy
        self._choose_loader = None if policy == "first_match" else POLICIES[policy]
        self._check_hma(vllm_config)
        hma_enabled = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        shape = PipelineShape.of(self.pipeline.name, (c.spec for c in self.children), hma_enabled)
        self._pairing = PairingCheck(shape)  # a prefill/decode pair's pipelines must match
        self._steps = 0  # scheduler side: metadata built so far
        # Worker side: off for the rest of a step whose synchronous load failed (see _loads_failed).
        self._layer_saves = True
        logger.info(
            "pipeline started", pipeline=self.pipeline.name, role=role.name.lower(),
            children=[f"{c.name}={c.spec.class_name}" for c in self.children], load_policy=self.pipeline.load.policy,
            metrics=self.pipeline.metrics.enabled,
            tracing=self.pipeline.tracing.granularity if self.pipeline.tracing.enabled else "off",
        )
        if self.pipeline.watchdog_s is not None:
            watchdog().watch(self, self.pipeline.name, role.name.lower(), self._child_calls, self.pipeline.watchdog_s,
                             self._instrumentation.calls_running if self._instrumentation is not None else None)

    def _guard_changed(self, guard: ChildGuard, state_changed: bool) -> None:
        self._child_calls.rebuild(self.children[self._guards.index(guard)])
        self._open_guards = [guard for guard in self._guards if not guard.closed]
        self._breakers_changed = self._breakers_changed or state_changed
        if state_changed and self._instrumentation is not None:
            self._instrumentation.breaker_changed(guard.name, guard.state.name.lower())

    def _child_failed(self, child_name: str, operation: Operation, error: Exception) -> None:
        """A child call raised (told by the child's guard, before it answers)."""
        if self._instrumentation is not None:
            self._instrumentation.failed(child_name, operation, error)

    def _answer(self, operation: Operation, call: Callable[..., Any], error: Exception) -> Any:
        """What the child whose ``call`` raised ``error`` answers (or ``error`` raised again: see its guard)."""
        return self._child_calls.owner(call).guard.answer(operation, error)

    def _load_failed(self, operation: Operation, call: Callable[..., Any], error: Exception) -> None:
        """A loader's ``call`` raised: once its guard has answered, its loads go back to vLLM."""
        child = self._child_calls.owner(call)
        child.guard.answer(operation, error)
        self._fail_loads(child.index)

    def _fail_loads(self, child_index: int) -> None:
        """The child failed this step: its loads go back to vLLM for recompute."""
        self._loads_failed(self._worker_ledger.fail_loads(child_index))

    def _loads_failed(self, plans: list[LoadPlan]) -> None:
        """A failed synchronous load means this step's forward reads blocks that
        were never filled: what it saves would poison the other tiers, so no
        child saves a layer until the step ends."""
        if self._layer_saves and any(not plan.load_async for plan in plans):
            self._layer_saves = False
            logger.warning("layer saves skipped for this step after a failed load",
                           connector=sorted({self.children[plan.child].name for plan in plans}))

    def request_state_sizes(self) -> dict[str, int]:
        """Sizes of the per-request maps that are not empty; none should outlive its requests."""
        sizes = {**self._scheduler_ledger.sizes(), **self._worker_ledger.sizes(), **self._deferrals.sizes()}
        if self._instrumentation is not None:
            sizes.update(self._instrumentation.sizes())
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
        for register in self._calls.register_kv_caches:
            register(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        for set_ops in self._calls.set_host_xfer_buffer_ops:
            set_ops(copy_operation)

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        """At most one child may own the KV cache memory pool."""
        pools = [(self._child_calls.owner(get_pool).name, pool)
                 for get_pool in self._calls.get_mem_pool_context if (pool := get_pool()) is not None]
        if len(pools) > 1:
            raise ValueError(
                f"kvcompose: children {[name for name, _ in pools]} each provide a KV cache memory pool; "
                "the KV cache lives in one pool, so configure a custom pool on one child only"
            )
        return pools[0][1] if pools else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, KVComposeMetadata)
        for guard in self._open_guards:
            guard.step_started()
        if cancelled := self._worker_ledger.begin_step(connector_metadata):
            self._loads_failed(cancelled)
        if self._instrumentation is not None:
            self._instrumentation.step_bound(connector_metadata)
        binds = self._calls.bind_connector_metadata
        for bind, metadata in zip(binds, connector_metadata.per_child, strict=True):
            try:
                bind(metadata)
            except Exception as error:  # without its metadata, the child cannot load this step
                self._load_failed(_BIND, bind, error)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        for clear in self._calls.clear_connector_metadata:
            try:
                clear()
            except Exception as error:
                self._answer(_CLEAR, clear, error)
        super().clear_connector_metadata()
        self._worker_ledger.end_step()
        self._layer_saves = True  # back to every step's layer saves
        if self._instrumentation is not None:
            self._instrumentation.step_cleared()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVComposeMetadata)
        handles = self._calls.handle_preemptions
        for handle, metadata in zip(handles, kv_connector_metadata.per_child, strict=True):
            try:
                handle(metadata)
            except Exception as error:
                self._answer(_PREEMPTIONS, handle, error)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        for start_load in self._calls.start_load_kv:
            try:
                start_load(forward_context, **kwargs)
            except Exception as error:
                self._load_failed(_START_LOAD, start_load, error)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for wait in self._calls.wait_for_layer_load:
            try:
                wait(layer_name)
            except Exception as error:
                self._load_failed(_LAYER_LOAD, wait, error)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        if not self._layer_saves:  # a synchronous load of this step failed
            return
        for save in self._calls.save_kv_layer:
            try:
                save(layer_name, kv_layer, attn_metadata, **kwargs)
            except Exception as error:
                self._answer(_LAYER_SAVE, save, error)

    def wait_for_save(self) -> None:
        for wait in self._calls.wait_for_save:
            try:
                wait()
            except Exception as error:
                self._answer(_WAIT_FOR_SAVE, wait, error)
        if self._instrumentation is not None and self._instrumentation.step_saves:
            self._instrumentation.saves_waited(self._layer_saves)

    def finish_forward(self) -> None:
        for finish in self._calls.finish_forward:
            try:
                finish()
            except Exception as error:
                self._answer(_FINISH_FORWARD, finish, error)

    def reset_capture_state(self) -> None:
        for reset in self._calls.reset_capture_state:
            reset()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Union of the children's results; a request counts as sent once its
        last async saver reports it. A child that failed gives up what it owes:
        its saves count as done, its receives as failed (vLLM recomputes)."""
        answers = []
        for get_results in self._calls.get_transfer_results:
            try:
                answers.append(get_results(finished_req_ids))
            except Exception as error:
                answers.append(self._answer(_TRANSFER_RESULTS, get_results, error))
        settled = self._worker_ledger.settle(answers)
        if self._instrumentation is not None:
            self._instrumentation.transfer_results(answers, finished_req_ids, settled)
        return settled

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The children's failed blocks, plus those of loads kvcompose gave back for a failed child."""
        failed: set[int] = set()
        for index, get_errors in enumerate(self._calls.get_block_ids_with_load_errors):
            try:
                child_failed = get_errors()
            except Exception as error:
                child_failed = self._answer(_LOAD_ERRORS, get_errors, error)
            if child_failed is FAILED:
                self._fail_loads(index)
            elif child_failed:
                failed |= child_failed
                if self._instrumentation is not None:
                    self._instrumentation.load_errors(index, child_failed)
        load_errors, given_back = self._worker_ledger.take_load_errors()
        if given_back and self._instrumentation is not None:
            self._instrumentation.loads_given_back(given_back)
        return failed | load_errors

    def get_finished_count(self) -> int | None:
        counts = [count() for count in self._calls.get_finished_count]
        if any(count is None for count in counts):
            return None
        distinct = set(counts)
        if len(distinct) > 1:
            raise ValueError(f"kvcompose: children report incompatible finished counts {sorted(distinct)}")
        return next(iter(distinct), None)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """The first child's handshake metadata that is not None."""
        for get_metadata in self._calls.get_handshake_metadata:
            if (metadata := get_metadata()) is not None:
                return metadata
        return None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Each child's worker metadata, and (tracing on) what the traced requests' transfers did, for the
        scheduler."""
        per_child = []
        for build in self._calls.build_connector_worker_meta:
            try:
                per_child.append(build())
            except Exception as error:
                per_child.append(self._answer(_WORKER_META, build, error))
        summaries = None
        if self._instrumentation is not None:
            summaries = self._instrumentation.worker_meta_built(per_child)
        if per_child.count(None) == len(per_child) and not summaries:
            return None
        return KVComposeWorkerMetadata(per_child=tuple(per_child), summaries=summaries)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Each child's own stats and its breaker's report, and (with metrics on) kvcompose's tables, since
        the last call."""
        native = {}
        for get_stats in self._calls.get_kv_connector_stats:  # the children that keep stats of their own
            try:
                child_stats = get_stats()
            except Exception as error:
                child_stats = self._answer(_STATS, get_stats, error)
            if child_stats is not None and not child_stats.is_empty():
                child = self._child_calls.owner(get_stats)
                native[child.name] = NativeStats(child.class_path, child_stats)
                if self._instrumentation is not None:
                    self._instrumentation.child_stats(child.index, child_stats)
        breakers = {}
        if self._open_guards or self._breakers_changed:  # else every circuit is closed and was at the last report
            self._breakers_changed = False
            breakers = {guard.name: report for guard in self._guards if (report := guard.take_report()) is not None}
        tables = self._instrumentation.take_tables() if self._instrumentation is not None else None
        if not (native or breakers or tables):
            return None
        return KVComposeStats(data={**(tables or {}), BREAKERS_KEY: breakers, NATIVE_KEY: native})

    # ==============================
    # Scheduler-side methods
    # ==============================

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        for bind in self._calls.bind_kv_cache_manager:
            bind(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        for bind in self._calls.bind_gpu_block_pool:
            bind(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Every loader is asked, in pipeline order, so each sees the request's lookup (as MultiConnector asks
        every child); a loader still looking (None tokens) makes the whole answer "ask again later", for at most
        watchdog_s (kvcompose.connectors.deferrals). The load policy picks the loader among the answers
        (first_match: the first with tokens, MultiConnector's rule)."""
        if request.kv_transfer_params:  # a remote prefill's: check the pair's pipelines match
            self._pairing.check(request.kv_transfer_params)
        answers = []
        first = None  # position of the first answer with tokens
        for lookup in self._calls.get_num_new_matched_tokens:
            try:
                answer = lookup(request, num_computed_tokens)
            except Exception as error:
                answer = self._answer(_LOOKUP, lookup, error)
            if answer[0] is None:
                if not self._deferrals.expired(request.request_id, self._child_calls.owner(lookup).index):
                    return None, False
                answer = self._answer(_LOOKUP, lookup, LookupDeferredTooLong(self._deferrals.limit_s or 0.0))
            tokens = answer[0]
            if first is None and tokens > 0:
                first = len(answers)
            answers.append(answer)
        if self._deferrals:
            self._deferrals.settled(request.request_id)
        chosen = first if self._choose_loader is None else self._choose_loader(answers)
        matched = _NO_MATCH if chosen is None else answers[chosen]
        self._scheduler_ledger.rounds[request.request_id] = (chosen, matched, num_computed_tokens, answers)
        return matched

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        loader = self._scheduler_ledger.loader_of(request.request_id)
        if loader is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        get_sources = self._calls.get_external_cache_hit_sources[loader]
        try:
            return get_sources(request, num_external_tokens)
        except Exception as error:
            return self._answer(_HIT_SOURCES, get_sources, error)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        loader = self._scheduler_ledger.loader_of(request.request_id)
        assert loader is not None, "vLLM asks only about requests a child loads"
        return self._calls.get_loaded_kv_cache_group_ids[loader](request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """The loading child gets the external token count; every other child
        gets the request's real blocks with 0 external tokens. The load is
        planned for the workers, or cancelled if the loading child failed."""
        loading = self._scheduler_ledger.loader_of(request.request_id) if num_external_tokens > 0 else None
        accepted = True
        for index, update in enumerate(self._calls.update_state_after_alloc):
            try:
                update(request, blocks, num_external_tokens if index == loading else 0)
            except Exception as error:
                self._answer(_AFTER_ALLOC, update, error)
                accepted = accepted and index != loading
        if loading is not None:
            self._scheduler_ledger.plan_load(request.request_id, blocks, num_external_tokens, accepted)
        if self._instrumentation is not None:
            lookup_round = self._scheduler_ledger.rounds.get(request.request_id)
            self._instrumentation.admitted(request, num_external_tokens,
                                           None if lookup_round is None else lookup_round[3],
                                           self._scheduler_ledger.planned_loader(request.request_id),
                                           0 if lookup_round is None else lookup_round[2])

    def on_new_request(self, request: Request) -> None:
        for on_new in self._calls.on_new_request:
            try:
                on_new(request)
            except Exception as error:
                self._answer(_NEW_REQUEST, on_new, error)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVComposeMetadata:
        """Each child's metadata, and what the workers need to repair failures.
        A child that fails here sends none, and its planned loads are cancelled."""
        per_child = []
        for index, build in enumerate(self._calls.build_connector_meta):
            try:
                per_child.append(build(scheduler_output))
            except Exception as error:
                self._answer(_BUILD_META, build, error)
                per_child.append(None)
                self._scheduler_ledger.cancel_loads_of(index)
        self._steps += 1
        metadata = KVComposeMetadata(per_child=tuple(per_child), step=self._steps)
        self._scheduler_ledger.fill(metadata)
        if self._instrumentation is not None:
            self._instrumentation.metadata_built(scheduler_output, metadata)
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Each child sees its own worker metadata in ``kv_connector_worker_meta``."""
        composite_meta = connector_output.kv_connector_worker_meta
        assert composite_meta is None or isinstance(composite_meta, KVComposeWorkerMetadata)
        if self._instrumentation is not None:
            self._instrumentation.worker_output(composite_meta)
            if connector_output.invalid_block_ids:
                self._instrumentation.blocks_failed(connector_output.invalid_block_ids)
        try:
            for index, update in enumerate(self._calls.update_connector_output):
                if composite_meta is not None:
                    connector_output.kv_connector_worker_meta = composite_meta.per_child[index]
                try:
                    update(connector_output)
                except Exception as error:
                    self._answer(_OUTPUT, update, error)
        finally:
            connector_output.kv_connector_worker_meta = composite_meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finish_request(request, block_ids, self._calls.request_finished, _FINISHED)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA variant of ``request_finished`` (only called when every child supports HMA)."""
        return self._finish_request(request, block_ids, self._calls.request_finished_all_groups,
                                    _FINISHED_ALL_GROUPS)

    def _finish_request(
        self, request: Request, block_ids: list[int] | tuple[list[int], ...],
        finishes: tuple[Callable[..., tuple[bool, dict[str, Any] | None]], ...], operation: Operation,
    ) -> tuple[bool, dict[str, Any] | None]:
        """Ask every child; merge their kv_transfer_params (a key clash is an
        error) and note its async savers so the request is reported sent once."""
        async_savers: list[int] = []
        params: dict[str, Any] | None = None
        try:
            for index, finish in enumerate(finishes):
                try:
                    saves_async, child_params = finish(request, block_ids)
                except Exception as error:
                    saves_async, child_params = self._answer(operation, finish, error)
                if saves_async:
                    async_savers.append(index)
                if child_params is not None:
                    if params is None:
                        params = child_params
                    elif clashes := params.keys() & child_params.keys():
                        raise RuntimeError(
                            f"kvcompose: child {self.children[index].name!r} returns kv_transfer_params keys "
                            f"{sorted(clashes)} that an earlier child already set"
                        )
                    else:
                        params.update(child_params)
        finally:
            self._scheduler_ledger.finished(request.request_id, async_savers)
            if self._deferrals:  # aborted while a child deferred its lookup
                self._deferrals.settled(request.request_id)
            if self._instrumentation is not None:
                self._instrumentation.request_finished(request, bool(async_savers))
        params = self._pairing.stamp(params)
        if self._instrumentation is not None and (receipt := self._instrumentation.receipt(request)) is not None:
            params = with_receipt(params, receipt)
        return bool(async_savers), params

    def register_finished_partial_tail(
        self, request: Request, block_ids: tuple[list[int], ...], partial_tail_offloads: list[tuple[int, int, int]]
    ) -> bool:
        accepted = [register(request, block_ids, partial_tail_offloads)
                    for register in self._calls.register_finished_partial_tail]
        return any(accepted)

    def take_events(self) -> Iterable[KVCacheEvent]:
        for take in self._calls.take_events:
            yield from take()

    def has_pending_block_frees(self) -> bool:
        return self._any_child(_FREES, self._calls.has_pending_block_frees)

    def has_pending_push_work(self) -> bool:
        return self._any_child(_PUSH, self._calls.has_pending_push_work)

    def _any_child(self, operation: Operation, calls: tuple[Callable[[], bool], ...]) -> bool:
        """True as soon as a child's call answers True (later children are not asked, as with ``any``)."""
        for call in calls:
            try:
                if call():
                    return True
            except Exception as error:
                if self._answer(operation, call, error):
                    return True
        return False

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        for set_metadata in self._calls.set_xfer_handshake_metadata:
            set_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        for set_metadata in self._calls.set_xfer_handshake_metadata_pp_aware:
            set_metadata(metadata)

    def reset_cache(self) -> bool:
        every_child_reset = True
        for reset in self._calls.reset_cache:  # every child is asked, even after one says no
            try:
                reset_ = reset()
            except Exception as error:
                reset_ = self._answer(_RESET, reset, error)
            every_child_reset = every_child_reset and reset_ is not False
        return every_child_reset

    def shutdown(self) -> None:
        """Close the instrumentation and shut every child down, whatever fails; then re-raise the last
        failure, if any."""
        failure: Exception | None = None
        watchdog().unwatch(self)
        if self._instrumentation is not None:
            try:
                self._instrumentation.close()
            except Exception as error:
                logger.error("instrumentation failed to close", error_type=type(error).__name__)
                failure = error
        self._call_every_child(_SHUTDOWN, self._calls.shutdown, failure=failure)

    def _call_every_child(
        self, operation: Operation, calls: tuple[Callable[[], Any], ...], failure: Exception | None = None,
    ) -> None:
        """Make every call, even after one fails; then re-raise the last failure (``failure``: one that
        happened before). A child's class from before vLLM added the operation has no call in ``calls``."""
        for call in calls:
            try:
                call()
            except Exception as error:
                name = self._child_calls.owner(call).name
                logger.error("child call failed", connector=name, op=operation.name, error_type=type(error).__name__)
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
        self._call_every_child(_UNREGISTER, self._calls.unregister_kv_caches)

    def restore_kv_caches(self) -> None:
        """After wake-up: every child registers again (each is asked even if one fails)."""
        self._call_every_child(_RESTORE, self._calls.restore_kv_caches)

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
