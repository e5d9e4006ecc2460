"""The composite's per-request books: who loads what, who still owes a save.

MultiConnector only needs to know which child loads a request and how many
async saves a finished request still waits for. kvcompose also keeps what it
takes to repair a child's failure the way vLLM expects: the blocks a load was
to fill (so vLLM recomputes them), the async loads in flight (so a failed
one is reported as a failed receive) and which children owe each async save
(so a failed child's share is released and the request's blocks are freed).

The scheduler's :class:`SchedulerLedger` hands its entries to the workers in
each step's metadata; each worker's :class:`WorkerLedger` settles them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.operations import FAILED, Failed, LookupRound
from kvcompose.wire.metadata import KVComposeMetadata, LoadPlan

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks


# A request's latest lookup round: the position (among the loaders) of the answer chosen (None: no loader
# loads it), that answer, the tokens vLLM had computed locally when it asked, and every loader's answer in
# pipeline order where they are kept (else None). A plain tuple, made on a lookup.
LookedUp = tuple["int | None", tuple[int, bool], int, "LookupRound | None"]


def external_block_ids(blocks: KVCacheBlocks, local_tokens: int, external_tokens: int, block_size: int) -> tuple[int, ...]:
    """The blocks a load fills: those after the local prefix, in the first KV cache group.
    (Only those are read: ``get_block_ids()`` would convert every block of every group.)"""
    filled = blocks.blocks[0][local_tokens // block_size : -(-(local_tokens + external_tokens) // block_size)]
    return tuple(block.block_id for block in filled)


class SchedulerLedger:
    def __init__(self, block_size: int, loaders: Sequence[int]) -> None:
        self._block_size = block_size
        self.loaders = tuple(loaders)  # the loaders' child indices, in the order they answer lookups
        # Request id -> its latest lookup round; written by the composite as it looks up, read by the
        # instrumentation when the request is admitted (hits and misses are counted then). Where no answer
        # is kept (MultiConnector's rule, metrics off) only a round that chose a loader is written, as
        # MultiConnector records only the loader: an older round can then outlive a later miss, harmlessly,
        # since vLLM asks who loads a request only after a lookup that matched.
        self.rounds: dict[str, LookedUp] = {}
        # Until the next step's metadata: loads planned or cancelled, async savers of finished requests.
        self._planned: dict[str, LoadPlan] = {}
        self._cancelled: dict[str, LoadPlan] = {}
        self._async_savers: dict[str, tuple[int, ...]] = {}

    def loader_of(self, req_id: str) -> int | None:
        """The index of the child chosen to load the request, if one was."""
        looked_up = self.rounds.get(req_id)
        if looked_up is None or looked_up[0] is None:
            return None
        return self.loaders[looked_up[0]]

    def planned_loader(self, req_id: str) -> int | None:
        """The index of the child whose load of the request is planned for the next step (it accepted it)."""
        plan = self._planned.get(req_id)
        return None if plan is None else plan.child

    def plan_load(self, req_id: str, blocks: KVCacheBlocks, external_tokens: int, accepted: bool) -> None:
        """Record the load the chosen child accepted (or failed to accept) for the workers."""
        chosen, (_, load_async), local_tokens, _ = self.rounds[req_id]
        assert chosen is not None, "a load is planned only for a request a loader was chosen for"
        block_ids = external_block_ids(blocks, local_tokens, external_tokens, self._block_size)
        plan = LoadPlan(self.loaders[chosen], block_ids, load_async)
        (self._planned if accepted else self._cancelled)[req_id] = plan

    def cancel_loads_of(self, child: int) -> None:
        for req_id in [r for r, plan in self._planned.items() if plan.child == child]:
            self._cancelled[req_id] = self._planned.pop(req_id)

    def finished(self, req_id: str, async_savers: list[int]) -> None:
        self.rounds.pop(req_id, None)
        if async_savers:
            self._async_savers[req_id] = tuple(async_savers)

    def fill(self, metadata: KVComposeMetadata) -> None:
        """Move what the workers need into this step's metadata."""
        metadata.async_saves = self._async_savers or None
        metadata.loads = self._planned or None
        metadata.cancelled_loads = self._cancelled or None
        self._async_savers, self._planned, self._cancelled = {}, {}, {}

    def sizes(self) -> dict[str, int]:
        entries = {"lookup_rounds": self.rounds, "planned_loads": self._planned, "cancelled_loads": self._cancelled,
                   "async_savers": self._async_savers}
        return {name: len(entries) for name, entries in entries.items() if entries}


class WorkerLedger:
    def __init__(self) -> None:
        self._step_loads: dict[str, LoadPlan] = {}  # this step's loads
        self._receiving: dict[str, int] = {}  # async loads in flight -> child index
        self._owed_saves: dict[str, set[int]] = {}  # request id -> children still owing its async save
        self._load_errors: set[int] = set()  # blocks to report for recompute
        self._given_back: dict[int, set[int]] = {}  # child index -> blocks of its loads given back to vLLM
        self._failed_recvs: set[str] = set()  # async loads to report as failed

    def begin_step(self, metadata: KVComposeMetadata) -> list[LoadPlan]:
        """Take the step's entries; returns the loads the scheduler already cancelled."""
        for req_id, savers in (metadata.async_saves or {}).items():
            self._owed_saves[req_id] = set(savers)
        self._step_loads = dict(metadata.loads or {})
        for req_id, plan in self._step_loads.items():
            if plan.load_async:
                self._receiving[req_id] = plan.child
        cancelled = metadata.cancelled_loads or {}
        for req_id, plan in cancelled.items():
            self._fail(req_id, plan)
        return list(cancelled.values())

    def end_step(self) -> None:
        self._step_loads = {}

    def fail_loads(self, child: int) -> list[LoadPlan]:
        """The child failed this step: its loads (not yet given back) go back to vLLM; returns them."""
        failed = {req_id: plan for req_id, plan in self._step_loads.items() if plan.child == child}
        for req_id, plan in failed.items():
            del self._step_loads[req_id]
            self._fail(req_id, plan)
        return list(failed.values())

    def _fail(self, req_id: str, plan: LoadPlan) -> None:
        self._given_back.setdefault(plan.child, set()).update(plan.block_ids)
        if plan.load_async:
            self._receiving.pop(req_id, None)
            self._failed_recvs.add(req_id)
        else:
            self._load_errors.update(plan.block_ids)

    def settle(self, answers: Sequence[KVConnectorTransferResults | Failed]) -> KVConnectorTransferResults:
        """The children's transfer results as one (``answers``: one per child, in pipeline order; FAILED: the
        child failed and gives up what it owes). A request counts as sent once no child owes its save; async
        loads given back to vLLM count as failed receives."""
        settled = KVConnectorTransferResults()
        for child, results in enumerate(answers):
            if results is FAILED:
                results = self.given_up(child)
            settled.finished_recving |= results.finished_recving
            settled.failed_recving |= results.failed_recving
            for req_id in results.finished_recving:
                self._receiving.pop(req_id, None)
            for req_id in results.finished_sending:
                if self._save_done(req_id, child):
                    settled.finished_sending.add(req_id)
        if self._failed_recvs:
            settled.failed_recving |= self._failed_recvs
            settled.finished_recving |= self._failed_recvs
            self._failed_recvs = set()
        return settled

    def _save_done(self, req_id: str, child: int) -> bool:
        owed = self._owed_saves.get(req_id)
        if owed is None:
            return True
        owed.discard(child)
        if owed:
            return False
        del self._owed_saves[req_id]
        return True

    def given_up(self, child: int) -> KVConnectorTransferResults:
        """What a failed child owed, as if it had finished: its saves done, its receives failed."""
        receiving = {req_id for req_id, owner in self._receiving.items() if owner == child}
        return KVConnectorTransferResults(
            finished_sending={req_id for req_id, owed in self._owed_saves.items() if child in owed},
            finished_recving=receiving,
            failed_recving=receiving,
        )

    def take_load_errors(self) -> tuple[set[int], dict[int, set[int]]]:
        """Blocks to report for recompute, and per child the blocks of every load given back."""
        errors, self._load_errors = self._load_errors, set()
        given_back, self._given_back = self._given_back, {}
        return errors, given_back

    def sizes(self) -> dict[str, int]:
        entries = {"step_loads": self._step_loads, "receiving": self._receiving, "owed_saves": self._owed_saves,
                   "load_errors": self._load_errors, "failed_recvs": self._failed_recvs,
                   "given_back": self._given_back}
        return {name: len(entries) for name, entries in entries.items() if entries}
