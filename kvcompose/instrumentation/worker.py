"""The worker side's instrumentation: each step's calls, its transfers and its engine wait.

Every step makes the same calls (one bind, one ``start_load_kv``, one
``wait_for_layer_load`` and ``save_kv_layer`` per layer, ...), so the worker
decides once per step, when the composite binds it, how the step's child calls
are made (:meth:`WorkerInstrumentation.step_bound` returns the calls the
composite makes until the step is cleared):

- a step that moves KV (it issues transfers, or transfers are open) or moves a
  traced request's KV: the observed calls, each timed and standing for itself;
  the blocking calls' time is engine wait and the copy time of the step's
  synchronous transfers; a traced step's calls make spans. So does a step
  without a forward pass (it makes no per-layer call, so it cannot stand for a
  forward step, nor one for it): they are rare, when the engine waits or goes
  idle;
- otherwise one step in ``metrics.sample_every``: the observed calls, standing
  for the steps not timed since the last sampled one;
- any other step: the plain calls, at MultiConnector's cost.

Hooks (the composite calls them): :meth:`step_bound`, :meth:`step_cleared`,
:meth:`saves_waited` (the step's ``wait_for_save`` returned),
:meth:`transfer_results`, :meth:`load_errors`, :meth:`loads_given_back`,
:meth:`child_stats`, :meth:`worker_meta_built`. With tensor parallelism only
the first worker tracks transfers and engine wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import time_ns
from typing import TYPE_CHECKING, Any

from kvcompose.connectors.calls import Fanout
from kvcompose.instrumentation.base import CallState, Instrumentation, engine_id_of
from kvcompose.instrumentation.economics import PrefillCost
from kvcompose.instrumentation.sampling import CallSampler
from kvcompose.instrumentation.transfers import StepWaits, TransferTracker, bytes_per_block, is_first_worker
from kvcompose.metrics.recorder import DENSE_FROM_WORKERS
from kvcompose.metrics.stats import ECONOMICS_KEY
from kvcompose.metrics.transfers import DIRECTIONS
from kvcompose.operations import FAILED, Failed, Operation
from kvcompose.tracing.pipeline import Summaries

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvcompose.config import Pipeline
    from kvcompose.connectors.calls import ChildCalls
    from kvcompose.connectors.children import ChildSpec
    from kvcompose.connectors.isolation import ChildGuard
    from kvcompose.connectors.metadata import KVComposeMetadata


class WorkerInstrumentation(Instrumentation):
    """See the module docstring."""

    def __init__(
        self, pipeline: Pipeline, specs: list[ChildSpec], guards: Sequence[ChildGuard], vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
    ) -> None:
        parallel = vllm_config.parallel_config
        super().__init__(pipeline, specs, "worker", engine_id_of(vllm_config),
                         ship_dense=parallel.world_size >= DENSE_FROM_WORKERS)
        self.tracker: TransferTracker | None = None
        if is_first_worker():  # with tensor parallelism the first worker tracks (bytes count every shard)
            self.tracker = TransferTracker(specs, guards, bytes_per_block(kv_cache_config, parallel.tensor_parallel_size),
                                           self.transfer_recorder, self.tracer)
        self.step_state = CallState()  # every operation's, set at bind
        # The engine's prefill cost per token, measured by the worker that tracks transfers (one is enough).
        self._prefill = PrefillCost() if self.tracker is not None and self.recorder.enabled else None
        self._bound_ns = 0  # when the step was bound
        self._computed = (0, 0)  # ... and the prompt tokens it prefills, the requests it decodes
        self._step_sampler = CallSampler(pipeline.metrics.sample_every) if self.recorder.enabled else None
        self._step = 0  # the bound step's number (load errors are counted by it)
        self._flush_at_take = False  # the next stats are flushed (a step without a forward pass)
        self._plain: Fanout | None = None
        self._observed: Fanout | None = None
        # The bound step has sync saves: the composite tells its wait_for_save (read on every wait_for_save).
        self.step_saves = False

    def calls_for(self, child_calls: ChildCalls) -> Fanout:
        self._plain, self._observed = child_calls.plain, child_calls.observed
        return child_calls.plain

    def state_of(self, operation: Operation) -> CallState:
        return self.step_state

    def waits_on(self, operation: Operation) -> StepWaits | None:
        return self.tracker.waits if operation.blocking is not None and self.tracker is not None else None

    # ---- the step ----

    def step_bound(self, metadata: KVComposeMetadata) -> Fanout:
        """The step's metadata is about to be bound: returns the calls the composite makes in this step."""
        assert self._plain is not None and self._observed is not None, "calls_for() comes first"
        self._step, self._flush_at_take = metadata.step, metadata.flush_stats
        self._bound_ns, self._computed = time_ns(), (metadata.prefill_tokens, metadata.decode_tokens)
        traced = self.tracer is not None and self.tracer.begin_step(metadata.traced_requests)
        contexts = self.tracer.step_contexts() if traced else {}  # type: ignore[union-attr]
        moves = self.tracker is not None and self.tracker.begin_step(metadata, contexts)
        self.step_saves = moves and self.tracker.saves_open  # type: ignore[union-attr]
        state = self.step_state
        if traced or moves or metadata.flush_stats:  # a step without a forward pass makes fewer calls
            state.weight, state.sampled = 1, 0
        elif self._step_sampler is not None and (weight := self._step_sampler.count()):
            state.weight, state.sampled = weight, self.next_sample()
        else:
            return self._plain
        state.parents = self.tracer.step_parents() if traced else ()  # type: ignore[union-attr]
        return self._observed

    def step_cleared(self) -> Fanout:
        """The step's metadata was cleared: returns the calls made until the next step."""
        self.step_saves = False
        if self.tracker is not None:
            if weight := self.step_state.weight:  # an observed step: its blocking calls' time is engine wait
                waited, waits = 0.0, self.tracker.waits
                for spec in self.specs:
                    for direction in DIRECTIONS:
                        if seconds := waits.of(spec.index, direction):
                            self.transfer_recorder.waited(spec.index, direction, seconds * weight)
                            waited += seconds
                if self._prefill is not None:  # the forward pass, without the children's part of it
                    self._prefill.step_ended((time_ns() - self._bound_ns) / 1e9 - waited, *self._computed)
            self.tracker.end_step()
        if self.tracer is not None:
            self.tracer.end_step()
        state = self.step_state
        state.weight, state.sampled, state.parents = 0, 0, ()
        assert self._plain is not None
        return self._plain

    def saves_waited(self, layer_saves: bool) -> None:
        """The step's ``wait_for_save`` returned, in a step with sync saves (:attr:`step_saves`); ``layer_saves``:
        false when a load of the step failed and the composite stopped the layer saves (they are then aborted)."""
        self.step_saves = False
        assert self.tracker is not None
        self.tracker.saves_waited(aborted=not layer_saves)

    # ---- what the children report ----

    def transfer_results(
        self, answers: Sequence[KVConnectorTransferResults | Failed], finished_req_ids: set[str],
        settled: KVConnectorTransferResults,
    ) -> None:
        """Every child's transfer results (FAILED: it raised, and gives up what it owes), and the composite's."""
        if self.tracker is None:
            return
        for child, results in enumerate(answers):
            if results is FAILED:
                self.tracker.child_failed(child)
            elif results.finished_sending or results.finished_recving or finished_req_ids:
                self.tracker.results(child, results, finished_req_ids)
        if settled.failed_recving:  # async loads kvcompose gave back to vLLM
            self.tracker.loads_given_back(settled.failed_recving)

    def load_errors(self, child: int, blocks: set[int]) -> None:
        """A child reported blocks it failed to load."""
        self.recorder.count_load_errors(self.specs[child].name, self._step, blocks)
        if self.tracker is not None:
            self.tracker.load_errors(blocks)

    def loads_given_back(self, blocks_by_child: dict[int, set[int]]) -> None:
        """The composite gave a failed child's loads back to vLLM: their blocks count as that child's load errors."""
        for child, blocks in blocks_by_child.items():
            self.load_errors(child, blocks)

    def child_stats(self, child: int, stats: Any) -> None:
        """A child's own stats of the step (NIXL's carry the copy time of its loads)."""
        if self.tracker is not None:
            self.tracker.child_stats(child, stats)

    def worker_meta_built(self, per_child: Sequence[Any]) -> Summaries | None:
        """The children's worker metadata of the step (jobs completed); returns the summaries of traced requests'
        transfers that ended, for the scheduler."""
        if self.tracker is None:
            return None
        self.tracker.end_sync_loads()
        for child, worker_meta in enumerate(per_child):
            if worker_meta is not None:
                self.tracker.worker_meta(child, worker_meta)
        return self.tracker.take_summaries() or None

    # ---- stats, state, shutdown ----

    def reports(self, idle: bool) -> dict[str, Any]:
        if self._prefill is not None and (report := self._prefill.report(now=idle)) is not None:
            return {ECONOMICS_KEY: report}
        return {}

    def flush_due(self) -> bool:
        return self._flush_at_take

    def flush(self) -> None:
        self._flush_at_take = False
        if self._step_sampler is not None:
            steps = self._step_sampler.take_uncredited()
            for operation in self._sampled:
                self.credit_untimed(operation, steps)

    def uncount(self, operation: Operation) -> None:
        """Steps are counted, not calls: a step whose call the watchdog timed still counts as untimed."""

    def sizes(self) -> dict[str, int]:
        sizes = super().sizes()
        if self.tracker is not None:
            sizes.update(self.tracker.sizes())
        return sizes

    def close(self) -> None:
        """Open transfers end as aborted; the tracer exports what it holds."""
        if self.tracker is not None:
            self.tracker.close()
        super().close()
