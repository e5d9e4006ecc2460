"""Per-process recording of the composite's calls into its children: latency, counts and what the calls meant.

The instrumentation (:mod:`kvcompose.instrumentation`) times every call
into a child and tells the recorder its latency: the latency histogram's
buckets, count and ``_sum`` are those of the calls kvcompose made.

What the calls meant is counted where vLLM counts it, told by the
instrumentation:

- lookups (hit or miss, tokens matched) once per admitted request, when vLLM
  first allocates its blocks, from the loaders' answers in the request's last
  lookup round (vLLM asks again every step while a request waits for blocks, and
  counts its own external-cache hits at admission too). vLLM allocates again for
  a request it admitted before (once an async load completes, when a preempted
  request resumes): the instrumentation tells only the first. A loader whose
  lookup failed is counted neither way;
- tokens loaded, at that first admission, for the child chosen to load (if it accepted), and the tokens a
  loader had beyond them (forgone by the load policy);
- blocks that failed to load, as block ids per scheduler step (see
  :class:`~kvcompose.wire.calls.CallTable`), so merging the workers' stats
  takes the union vLLM takes;
- every failure a child call raised (from its guard).

Threads: vLLM 0.30-0.33 calls a connector from one thread per process, but a
child may report from threads of its own and the watchdog records from its
own. A timed call is one list append (atomic); counting, errors and taking
the stats hold a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

from kvcompose.operations import FAILED_LOOKUP, Granularity, Operation
from kvcompose.wire.calls import COUNTERS, OPS, CallTable, ErrorCounts, LoadErrors
from kvcompose.wire.grid import Cells, observe

# From this many workers up, a worker ships its table dense: the scheduler then
# merges each worker's table in one array operation (see kvcompose.wire.calls).
DENSE_FROM_WORKERS = 8

# Timed calls kept unbucketed before they are folded into the table; bounds the
# memory of a process whose stats nobody takes (vLLM takes them every step).
MAX_PENDING_CALLS = 1 << 16

_NO_COUNTS = [0] * len(COUNTERS)
_HITS, _MISSES, _MATCHED, _LOADED, _FORGONE = (COUNTERS.index(name) for name in (
    "lookup_hits", "lookup_misses", "matched_tokens", "loaded_tokens", "forgone_tokens"))


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
        self._pending: list[tuple[int, float]] = []  # (slot, seconds), not folded yet
        self._counts = [[0] * len(COUNTERS) for _ in self._children]
        self._errors: ErrorCounts = {}
        self._load_errors: LoadErrors = {}
        self._counted = False  # counters or errors since the last take (read without the lock)

    # ---- timing ----

    def label(self, operation: Operation) -> str | None:
        """The ``op`` label of an operation timed in this pipeline; None if it is not."""
        if not self.enabled or (operation.granularity is Granularity.LAYER and not self.per_layer):
            return None
        return operation.label

    def slot(self, child: int, label: str) -> int:
        """Where the timed calls of child ``child`` (its index) and operation ``label`` are kept."""
        return child * len(OPS) + OPS.index(label)

    def timed(self, slot: int, seconds: float) -> None:
        """A call of ``slot`` took ``seconds``."""
        if len(self._pending) >= MAX_PENDING_CALLS:
            with self._lock:
                self._fold_pending()
        self._pending.append((slot, seconds))

    # ---- what the calls meant, told by the instrumentation ----

    def request_admitted(
        self, answers: Sequence[tuple[int, bool]], loaders: Sequence[int], loading: int | None, external_tokens: int,
    ) -> None:
        """vLLM first allocated a request's blocks: count its last lookup round (``answers``, one per loader, whose
        child indices ``loaders`` lists), and the tokens the child at index ``loading`` (None: no child) loads.
        Where a loader had more tokens than the one chosen (``first_match`` chose an earlier, shorter one), the
        difference is counted as tokens forgone, for the loader that had the most: what ``longest_match`` would
        have loaded beyond the configured policy."""
        if not self.enabled:
            return
        longest, most = None, external_tokens if loading is not None else 0
        with self._lock:
            for child, answer in zip(loaders, answers, strict=False):
                if answer is FAILED_LOOKUP:
                    continue
                counts = self._counts[child]
                if answer[0] > 0:
                    counts[_HITS] += 1
                    counts[_MATCHED] += answer[0]
                else:
                    counts[_MISSES] += 1
                if answer[0] > most:
                    longest, most = child, answer[0]
            if loading is not None:
                self._counts[loading][_LOADED] += external_tokens
            if longest is not None:
                self._counts[longest][_FORGONE] += most - (external_tokens if loading is not None else 0)
            self._counted = True

    def count_load_errors(self, child_name: str, step: int, block_ids: Collection[int]) -> None:
        """Blocks the child failed to load in scheduler step ``step`` (reported by it, or
        given back to vLLM by kvcompose after it failed)."""
        if self.enabled and block_ids:
            with self._lock:
                self._load_errors.setdefault(child_name, {}).setdefault(step, set()).update(block_ids)
                self._counted = True

    def count_error(self, child_name: str, operation: Operation, error: Exception) -> None:
        """A child call raised ``error`` (told by the child's guard, whether the call was timed or not)."""
        if self.enabled:
            op, error_type = operation.label or operation.name, type(error).__name__
            with self._lock:
                by_type = self._errors.setdefault(child_name, {}).setdefault(op, {})
                by_type[error_type] = by_type.get(error_type, 0) + 1
                self._counted = True

    # ---- handing the stats over ----

    def take(self) -> CallTable | None:
        """The calls since the last take (None if there were none), then start afresh."""
        if not (self._pending or self._counted or self._bucketed):
            return None
        with self._lock:
            self._counted = False
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

    def _fold_pending(self) -> None:
        """Sort the timed calls into their cells (holding the lock). Calls appended meanwhile by other threads
        land after the ones taken, and stay."""
        entries = self._pending[:]
        del self._pending[: len(entries)]
        for slot, seconds in entries:
            observe(self._bucketed, slot, self._bounds, seconds)
