"""Per-process recording of every child call: latency, errors and what the call meant.

The composite asks :meth:`PipelineRecorder.wrap` to wrap each child operation
once, at start-up. A wrapped call costs two clock reads and one list append;
latencies are sorted into buckets only when vLLM asks for the step's stats
(:meth:`PipelineRecorder.take`).

What the calls meant is counted where vLLM counts it, by the composite's hooks:

- lookups (hit or miss, tokens matched) once per admitted request, when vLLM
  allocates its blocks (``update_state_after_alloc``), from the children's
  answers in the request's last lookup round: vLLM asks again every step while
  a request waits for blocks, and counts its own external-cache hits at
  admission too. Like vLLM's hit ratio, a request readmitted after preemption
  is not counted again. Every lookup call is still timed (the ``lookup``
  operation's call count includes the retries);
- tokens loaded, at admission, for the child chosen to load;
- blocks that failed to load, as block ids per scheduler step (see
  :class:`~kvcompose.metrics.table.CallTable`), so merging the workers' stats
  takes the union vLLM takes.

Thread safety: vLLM 0.30-0.33 calls a connector from one thread per process,
but nothing here relies on it. A timed call appends one ``(slot, seconds)``
tuple, and a lookup's answer is one store into its request's list, both atomic;
folding, counting, errors and taking the stats hold a lock. Calls from several
threads are counted exactly, and the one thread vLLM uses takes no lock per call.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Collection, Iterable, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any

from kvcompose.metrics.table import COUNTERS, OPS, CallTable, Cells, ErrorCounts, LoadErrors
from kvcompose.operations import OPERATIONS, Granularity

if TYPE_CHECKING:
    from vllm.v1.request import Request

LOOKUP = "get_num_new_matched_tokens"

# From this many workers up, a worker ships its table dense: the scheduler then
# merges each worker's table in one array operation (see kvcompose.metrics.table).
DENSE_FROM_WORKERS = 8

# Latencies kept unbucketed before they are folded into the table; bounds the
# memory of a process whose stats nobody takes (vLLM takes them every step).
MAX_PENDING_CALLS = 1 << 16

_NO_COUNTS = [0] * len(COUNTERS)
_HITS, _MISSES, _MATCHED, _LOADED = (COUNTERS.index(name) for name in (
    "lookup_hits", "lookup_misses", "matched_tokens", "loaded_tokens"))


class PipelineRecorder:
    """Every child's calls in this process since the last :meth:`take`; records nothing when metrics are off."""

    def __init__(
        self, enabled: bool, bounds: Sequence[float], child_names: Sequence[str], per_layer: bool = False,
        ship_dense: bool = False,
    ) -> None:
        self.enabled = enabled
        self.per_layer = per_layer
        self._ship_dense = ship_dense
        self._children = tuple(child_names)
        self._bounds = tuple(bounds)
        self._lock = threading.Lock()
        self._bucketed: Cells = {}  # calls folded since the last take
        # Filled on the hot path, in place (wrappers hold a reference to it): (child * len(OPS) + op, seconds).
        self._pending: list[tuple[int, float]] = []
        self._counts = [[0] * len(COUNTERS) for _ in self._children]
        self._errors: ErrorCounts = {}
        self._load_errors: LoadErrors = {}
        # Request id -> each child's answer (tokens; None: not asked or failed) in its last lookup round.
        self._lookups: dict[str, list[int | None]] = {}

    def wrap(self, child_name: str, operation: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call``, timed and counted; unwrapped when metrics are off, for operations
        without a label and, unless ``per_layer``, the per-layer ones."""
        op = self._label(operation)
        if not self.enabled or op is None:
            return call
        row = self._children.index(child_name)
        slot = row * len(OPS) + OPS.index(op)
        pending = self._pending
        lookups = self._lookups if operation == LOOKUP else None

        def failed(start: float, error: Exception) -> None:
            pending.append((slot, perf_counter() - start))
            self._count_error(child_name, op, type(error).__name__)

        # Positional arguments only where the operation takes no keywords: packing an empty
        # ``**kwargs`` costs about a quarter of a timed call. The two bodies are the same on purpose:
        # a helper shared by both would cost the frame this saves.
        if OPERATIONS[operation].keywords:

            def observed(*args: Any, **kwargs: Any) -> Any:
                start = perf_counter()
                try:
                    result = call(*args, **kwargs)
                except Exception as error:
                    failed(start, error)
                    raise
                pending.append((slot, perf_counter() - start))
                if len(pending) >= MAX_PENDING_CALLS:
                    self._fold()
                return result

        else:

            def observed(*args: Any) -> Any:
                start = perf_counter()
                try:
                    result = call(*args)
                except Exception as error:
                    failed(start, error)
                    raise
                pending.append((slot, perf_counter() - start))
                if len(pending) >= MAX_PENDING_CALLS:
                    self._fold()
                if lookups is not None and (answers := lookups.get(args[0].request_id)) is not None:
                    answers[row] = result[0]
                return result

        observed.__wrapped__ = call  # type: ignore[attr-defined]
        return observed

    def _label(self, operation: str) -> str | None:
        """The ``op`` label of a timed operation; None if it is not timed."""
        declared = OPERATIONS[operation]
        if declared.granularity is Granularity.LAYER and not self.per_layer:
            return None
        return declared.label

    # ---- what the calls meant, told by the composite ----

    def lookup_started(self, request_id: str) -> None:
        """The composite is asking its loaders about a request: this round's answers replace the last one's."""
        if self.enabled:
            self._lookups[request_id] = [None] * len(self._children)

    def request_admitted(self, request: Request, loading: int | None, external_tokens: int) -> None:
        """vLLM allocated the request's blocks: count its last lookup round, and the tokens
        the child at index ``loading`` (None: no child) loads."""
        if not self.enabled:
            return
        answers = self._lookups.pop(request.request_id, None)
        with self._lock:
            if answers is not None and not getattr(request, "num_preemptions", 0):
                for counts, tokens in zip(self._counts, answers, strict=True):
                    if tokens is None:
                        continue
                    if tokens > 0:
                        counts[_HITS] += 1
                        counts[_MATCHED] += tokens
                    else:
                        counts[_MISSES] += 1
            if loading is not None:
                self._counts[loading][_LOADED] += external_tokens

    def request_finished(self, request_id: str) -> None:
        """A request that was looked up but never admitted leaves nothing behind."""
        self._lookups.pop(request_id, None)

    @property
    def open_lookups(self) -> int:
        """Requests looked up and not yet admitted or finished."""
        return len(self._lookups)

    def count_load_errors(self, child_name: str, step: int, block_ids: Collection[int]) -> None:
        """Blocks the child failed to load in scheduler step ``step`` (reported by it, or
        given back to vLLM by kvcompose after it failed)."""
        if self.enabled and block_ids:
            with self._lock:
                self._load_errors.setdefault(child_name, {}).setdefault(step, set()).update(block_ids)

    def count_isolated_error(self, child_name: str, operation: str, error: Exception) -> None:
        """A failure error isolation caught in a call this recorder did not time (and so did not count)."""
        if self.enabled and self._label(operation) is None:
            self._count_error(child_name, OPERATIONS[operation].label or operation, type(error).__name__)

    # ---- handing the stats over ----

    def take(self) -> CallTable | None:
        """The calls since the last take (None if there were none), then start afresh."""
        with self._lock:
            if not (self._pending or self._bucketed or self._errors or self._load_errors
                    or any(map(any, self._counts))):
                return None
            self._fold_pending()
            counters = [count for child_counts in self._counts for count in child_counts]
            table = CallTable(self._children, len(self._bounds) + 1, self._bucketed, counters, self._errors,
                              self._load_errors)
            self._bucketed, self._errors, self._load_errors = {}, {}, {}
            for child_counts in self._counts:
                child_counts[:] = _NO_COUNTS
        if self._ship_dense:
            table.densify()
        return table

    def _count_error(self, child_name: str, op: str, error_type: str) -> None:
        with self._lock:
            by_type = self._errors.setdefault(child_name, {}).setdefault(op, {})
            by_type[error_type] = by_type.get(error_type, 0) + 1

    def _fold(self) -> None:
        with self._lock:
            self._fold_pending()

    def _fold_pending(self) -> None:
        """Sort the pending latencies into their cells, for the next take (holding the lock).
        Calls appended meanwhile by other threads land after the ones taken, and stay."""
        calls = self._pending[:]
        del self._pending[: len(calls)]
        bucket_latencies(calls, self._bounds, into=self._bucketed)


def bucket_latencies(calls: Iterable[tuple[int, float]], bounds: Sequence[float], into: Cells) -> None:
    """Count each call's latency, and add it up, in the cell of its slot and bucket: bucket ``i``
    holds ``bounds[i-1] < v <= bounds[i]`` (Prometheus' ``le``), the last one the rest."""
    buckets = len(bounds) + 1
    for slot, latency in calls:
        cell = slot * buckets + bisect_left(bounds, latency)
        if (entry := into.get(cell)) is None:
            into[cell] = [1, latency]
        else:
            entry[0] += 1
            entry[1] += latency
