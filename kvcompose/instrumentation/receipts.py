"""What each request really got, tier by tier: its receipt, and how right its router's prediction was.

A request's prompt tokens come from three places: the GPU prefix cache (the
local hit vLLM had when it looked the request up), the child that loaded
(the external tokens it was chosen for), and the engine's own prefill (the
rest). :class:`Receipts` keeps these books per request from the scheduler
instrumentation's hooks and closes them when the request finishes:

- ``admitted``: the figures of vLLM's first scheduling of the request, as
  vLLM reports them (``usage.prompt_tokens_details.cached_tokens``). vLLM
  allocates again for the same request after an async load completes (no new
  lookup: nothing changes) and after a preemption (vLLM keeps the first
  figures: so do these books). A request whose async load failed outright is
  looked up afresh (vLLM set its computed tokens back to 0): the new lookup's
  figures replace the old.
- ``planned``: the blocks each load fills, from the step's metadata; a load
  the composite cancelled (its child failed) loads nothing.
- ``blocks_failed``: vLLM's ``invalid_block_ids`` of a step. vLLM truncates
  the request's computed tokens at its first invalid block and recomputes
  from there; the tokens of the load before that block count as loaded, the
  rest as recomputed (part of ``computed_tokens``).
- ``finished``: the receipt (with ``receipts: true``), and the prediction's
  counts in the :class:`~kvcompose.wire.routing.RoutingReport`.

A receipt that comes back inside a later request's ``kv_transfer_params`` (a
prefill/decode proxy forwards them) is never read: only
``predicted_cached_tokens`` is, and only as a number checked against the
prompt's length. Nothing of the prompt, its tokens or its block hashes goes in
a receipt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcompose.instrumentation.base import Instrumentation
from kvcompose.logs import get_logger
from kvcompose.wire.routing import PARAMS_KEY, PREDICTED_KEY, RoutingReport
from kvcompose.wire.stats import ROUTING_KEY

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvcompose.child_spec import ChildSpec
    from kvcompose.config import Pipeline
    from kvcompose.operations import LookupRound
    from kvcompose.tracing.pipeline import PipelineTracer
    from kvcompose.wire.metadata import KVComposeMetadata

logger = get_logger("receipts")

INVALID = -1  # a prediction that is not an integer from 0 to the prompt's length

# Keys of a receipt, beside those of the pairing description that may share the "kvcompose" entry.
RECEIPT_KEYS = ("prompt_tokens", "gpu_cached_tokens", "tiers", "computed_tokens", "recomputed_tokens", "loaded_from",
                "trace_id")


def prediction_of(params: Any, prompt_tokens: int) -> int | None:
    """The router's prediction in a request's ``kv_transfer_params``: None where it carries none, :data:`INVALID`
    where it is not an integer from 0 to ``prompt_tokens`` (or the ``kvcompose`` entry is not an object). Reads two
    keys, whatever the nesting or size of the rest."""
    if not isinstance(params, Mapping) or (entry := params.get(PARAMS_KEY)) is None:
        return None
    if not isinstance(entry, Mapping):
        return INVALID
    if (value := entry.get(PREDICTED_KEY)) is None:
        return None  # a pairing description or a receipt forwarded by a proxy: no prediction
    if type(value) is not int or not 0 <= value <= prompt_tokens:
        return INVALID
    return value


def with_receipt(params: dict[str, Any] | None, receipt: dict[str, Any]) -> dict[str, Any] | None:
    """``params`` (what the children return, stamped) with ``receipt`` as their ``kvcompose`` entry, merged into the
    pairing description where there is one. A child's own ``kvcompose`` key is never replaced: the receipt is left
    out then (logged once)."""
    if params is None:
        return {PARAMS_KEY: receipt}
    entry = params.get(PARAMS_KEY)
    if entry is None:
        params[PARAMS_KEY] = receipt
    elif isinstance(entry, Mapping) and "pipeline" in entry and "children" in entry and \
            not any(key in entry for key in RECEIPT_KEYS):  # the pairing description (shared: copied, not changed)
        params[PARAMS_KEY] = {**entry, **receipt}
    elif not _warned:
        _warned.append(True)
        logger.warning("a child returns kv_transfer_params key 'kvcompose': receipts are left out of its requests")
    return params


_warned: list[bool] = []


@dataclass(slots=True)
class _Books:
    """One request's figures (tokens)."""

    predicted: int | None  # the router's prediction; None: none; INVALID
    local: int = 0  # the GPU prefix cache's hit
    loader: int | None = None  # the child index of the load's child
    loaded: int = 0  # the tokens it loads, less those that failed
    recomputed: int = 0  # tokens a child was to load but did not
    blocks: tuple[int, ...] = ()  # the blocks the load fills, while its failures may still be reported


class Receipts:
    """See the module docstring. ``receipts``: write receipts (else only requests with a prediction are kept);
    ``predictions``: read predictions (the counts are exported: metrics on)."""

    def __init__(self, specs: Sequence[ChildSpec], loaders: Sequence[int], block_size: int, receipts: bool,
                 predictions: bool) -> None:
        self._names = [spec.name for spec in specs]
        self._loader_names = [specs[index].name for index in loaders]
        self._block_size = block_size
        self.receipts, self.predictions = receipts, predictions
        self._books: dict[str, _Books] = {}
        self._report = RoutingReport()
        self._last: tuple[str, dict[str, Any]] | None = None  # the last finished request's receipt

    def admitted(self, request: Request, num_external_tokens: int, local_tokens: int, loading: int | None) -> None:
        """vLLM allocated the request's blocks after a lookup that found ``local_tokens`` in the GPU cache and
        ``num_external_tokens`` for child ``loading`` (None: none, or its child failed to accept them)."""
        if request.num_computed_tokens:  # allocated again once an async load completed: no new lookup
            return
        books = self._books.get(request.request_id)
        if books is None:
            predicted = (prediction_of(request.kv_transfer_params, request.num_prompt_tokens)
                         if self.predictions else None)
            if predicted is None and not self.receipts:
                return
            books = self._books[request.request_id] = _Books(predicted)
        elif request.num_preemptions > 0:  # resumed after a preemption: vLLM keeps the first scheduling's figures
            books.blocks = ()
            return
        books.local = local_tokens
        books.loader = loading
        books.loaded = num_external_tokens if loading is not None else 0
        books.recomputed = num_external_tokens - books.loaded
        books.blocks = ()

    def planned(self, metadata: KVComposeMetadata) -> None:
        """The step's loads (the blocks each fills) and the loads the composite cancelled."""
        books = self._books
        for req_id, plan in (metadata.loads or {}).items():
            if (entry := books.get(req_id)) is not None:
                entry.blocks = plan.block_ids
        for req_id in metadata.cancelled_loads or ():
            if (entry := books.get(req_id)) is not None:
                entry.recomputed += entry.loaded
                entry.loaded, entry.blocks = 0, ()

    def preempted(self, req_ids: Any) -> None:
        """Preempted requests free their blocks (which other requests may get): their loads' failures are over."""
        for req_id in req_ids:
            if (entry := self._books.get(req_id)) is not None:
                entry.blocks = ()

    def blocks_failed(self, block_ids: set[int]) -> None:
        """vLLM's invalid blocks of a step: each load that fills one keeps its tokens before that block."""
        size = self._block_size
        for entry in self._books.values():
            if not entry.blocks:
                continue
            first = next((index for index, block in enumerate(entry.blocks) if block in block_ids), None)
            if first is None:
                continue
            kept = max(0, min(entry.loaded, (entry.local // size + first) * size - entry.local))
            entry.recomputed += entry.loaded - kept
            entry.loaded, entry.blocks = kept, ()

    def finished(self, request: Request, tracer: PipelineTracer | None) -> None:
        """Close the request's books: count its prediction, and keep its receipt for :meth:`receipt`."""
        self._last = None
        entry = self._books.pop(request.request_id, None)
        if entry is None:
            return
        reused = entry.local + entry.loaded
        if entry.predicted == INVALID:
            self._report.invalid += 1
        elif entry.predicted is not None:
            self._report.predicted(entry.predicted, reused)
        if not self.receipts:
            return
        tiers = dict.fromkeys(self._loader_names, 0)
        loaded_from = None
        if entry.loader is not None and entry.loaded:
            loaded_from = self._names[entry.loader]
            tiers[loaded_from] = entry.loaded
        prompt = request.num_prompt_tokens
        receipt: dict[str, Any] = {
            "prompt_tokens": prompt, "gpu_cached_tokens": entry.local, "tiers": tiers,
            "computed_tokens": prompt - reused, "recomputed_tokens": entry.recomputed, "loaded_from": loaded_from,
        }
        if tracer is not None and (context := tracer.request_context(request)) is not None:
            receipt["trace_id"] = f"{context.trace_id:032x}"
        self._last = (request.request_id, receipt)

    def receipt(self, request: Request) -> dict[str, Any] | None:
        """The receipt of the request that just finished (None: receipts off, or it was never scheduled)."""
        last, self._last = self._last, None
        return last[1] if last is not None and last[0] == request.request_id else None

    def report(self) -> dict[str, Any]:
        """The predictions' counts since the last report, by stats key (empty: none)."""
        if self._report.is_empty():
            return {}
        report, self._report = self._report, RoutingReport()
        return {ROUTING_KEY: report}

    def sizes(self) -> dict[str, int]:
        return {"receipt_books": len(self._books)} if self._books else {}


class ReceiptInstrumentation(Instrumentation):
    """The scheduler's instrumentation where the pipeline turns metrics and tracing off but receipts on: the
    receipts' books and nothing else (no call is timed)."""

    def __init__(self, pipeline: Pipeline, specs: list[ChildSpec], receipts: Receipts, engine_id: str) -> None:
        super().__init__(pipeline, specs, "scheduler", engine_id)
        self.receipts = receipts

    def admitted(self, request: Request, num_external_tokens: int, lookup_round: LookupRound | None,
                 loading: int | None, local_tokens: int = 0) -> None:
        self.receipts.admitted(request, num_external_tokens, local_tokens, loading)

    def metadata_built(self, scheduler_output: SchedulerOutput, metadata: KVComposeMetadata) -> None:
        if metadata.loads or metadata.cancelled_loads:
            self.receipts.planned(metadata)
        if scheduler_output.preempted_req_ids:
            self.receipts.preempted(scheduler_output.preempted_req_ids)

    def blocks_failed(self, block_ids: set[int]) -> None:
        self.receipts.blocks_failed(block_ids)

    def request_finished(self, request: Request, saves_async: bool) -> None:
        self.receipts.finished(request, None)

    def receipt(self, request: Request) -> dict[str, Any] | None:
        return self.receipts.receipt(request)

    def sizes(self) -> dict[str, int]:
        return self.receipts.sizes()
