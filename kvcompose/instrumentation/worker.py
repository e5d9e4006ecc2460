"""The worker side's instrumentation: each step's calls, its transfers and its engine wait.

Every call into a child is timed (see :mod:`kvcompose.instrumentation.base`).
Per step, the worker binds what the calls' time means: the blocking calls'
time is engine wait and the copy time of the step's synchronous transfers,
and the calls of a traced step make spans under it.

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

from kvcompose.instrumentation.base import Instrumentation, engine_id_of
from kvcompose.instrumentation.economics import PrefillCost
from kvcompose.instrumentation.transfers import StepWaits, TransferTracker, bytes_per_block, is_first_worker
from kvcompose.metrics.recorder import DENSE_FROM_WORKERS
from kvcompose.operations import DIRECTIONS, FAILED, Failed, Operation
from kvcompose.wire.metadata import Summaries
from kvcompose.wire.stats import ECONOMICS_KEY

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvcompose.child_spec import ChildSpec
    from kvcompose.config import Pipeline
    from kvcompose.instrumentation.transfers import GuardRecord
    from kvcompose.wire.metadata import KVComposeMetadata


class WorkerInstrumentation(Instrumentation):
    """See the module docstring."""

    def __init__(
        self, pipeline: Pipeline, specs: list[ChildSpec], guards: Sequence[GuardRecord], vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
    ) -> None:
        parallel = vllm_config.parallel_config
        super().__init__(pipeline, specs, "worker", engine_id_of(vllm_config),
                         ship_dense=parallel.world_size >= DENSE_FROM_WORKERS)
        self.tracker: TransferTracker | None = None
        if is_first_worker():  # with tensor parallelism the first worker tracks (bytes count every shard)
            self.tracker = TransferTracker(specs, guards, bytes_per_block(kv_cache_config, parallel.tensor_parallel_size),
                                           self.transfer_recorder, self.tracer)
        # The engine's prefill cost per token, measured by the worker that tracks transfers (one is enough).
        self._prefill = PrefillCost() if self.tracker is not None and self.recorder.enabled else None
        self._bound_ns = 0  # when the step was bound
        self._computed = (0, 0)  # ... and the prompt tokens it prefills, the requests it decodes
        self._step = 0  # the bound step's number (load errors are counted by it)
        self._report_at_take = False  # the bound step's stats carry kvcompose's tables
        self._idle_at_take = False  # ... and report what changed at once (a step without a forward pass)

    def waits_on(self, operation: Operation) -> StepWaits | None:
        return self.tracker.waits if operation.blocking is not None and self.tracker is not None else None

    # ---- the step ----

    def step_bound(self, metadata: KVComposeMetadata) -> None:
        """The step's metadata is about to be bound: its transfers begin, and its calls join its trace."""
        self._step, self._report_at_take, self._idle_at_take = (metadata.step, metadata.report_stats,
                                                                metadata.flush_stats)
        self._bound_ns, self._computed = time_ns(), (metadata.prefill_tokens, metadata.decode_tokens)
        traced = self.tracer is not None and self.tracer.begin_step(metadata.traced_requests)
        contexts = self.tracer.step_contexts() if traced else {}  # type: ignore[union-attr]
        moves = self.tracker is not None and self.tracker.begin_step(metadata, contexts)
        self.step_saves = moves and self.tracker.saves_open  # type: ignore[union-attr]
        self.step_parents.spans = self.tracer.step_parents() if traced else ()  # type: ignore[union-attr]

    def step_cleared(self) -> None:
        """The step's metadata was cleared: its blocking calls' time is engine wait."""
        self.step_saves = False
        if self.tracker is not None:
            waited, waits = 0.0, self.tracker.waits
            for spec in self.specs:
                for direction in DIRECTIONS:
                    if seconds := waits.of(spec.index, direction):
                        self.transfer_recorder.waited(spec.index, direction, seconds)
                        waited += seconds
            if self._prefill is not None and self._computed[0]:
                # A step that prefills: its forward pass, without the children's part of it.
                self._prefill.step_ended((time_ns() - self._bound_ns) / 1e9 - waited, *self._computed)
            self.tracker.end_step()
        if self.tracer is not None:
            self.tracer.end_step()
        self.step_parents.spans = ()

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

    def take_due(self) -> tuple[bool, bool]:
        """As the scheduler said in the step's metadata: every worker of the engine sends its tables at the same
        step, so a block that failed to load on several of them is merged into one count (kvcompose.wire.calls).
        The scheduler asks for the tables at every step without a forward pass too."""
        due, idle = self._report_at_take, self._idle_at_take
        self._report_at_take = self._idle_at_take = False
        return due, idle

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
