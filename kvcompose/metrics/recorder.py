"""Per-process recording of every child call: latency, errors and what the call meant.

The composite asks :meth:`PipelineRecorder.wrap` to wrap each child operation
once, at start-up. A wrapped call costs two clock reads and two list appends;
latencies are sorted into buckets only when vLLM asks for the step's stats
(:meth:`PipelineRecorder.take`). For the operations in ``_RESULT_COUNTERS``
the wrapper also counts what the call meant (a lookup hit or miss, tokens
matched or loaded, blocks that failed to load).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

from kvcompose.metrics.table import COUNTERS, OPS, CallTable, Cells, ErrorCounts

# Operations recorded, as they are named in Prometheus' ``op`` label.
OPERATION_LABELS: dict[str, str] = {
    "get_num_new_matched_tokens": "lookup",
    "update_state_after_alloc": "update_state_after_alloc",
    "build_connector_meta": "build_connector_meta",
    "request_finished": "request_finished",
    "request_finished_all_groups": "request_finished",
    "start_load_kv": "start_load_kv",
    "wait_for_save": "wait_for_save",
    "get_transfer_results": "get_transfer_results",
    "get_block_ids_with_load_errors": "get_block_ids_with_load_errors",
}

# Called once per layer per step: timed only with ``metrics.per_layer`` (a
# timed call costs several times what MultiConnector spends per layer).
PER_LAYER_OPERATIONS: dict[str, str] = {
    "wait_for_layer_load": "wait_for_layer_load",
    "save_kv_layer": "save_kv_layer",
}

# From this many workers up, a worker ships its table dense: the scheduler then
# merges each worker's table in one array operation (see kvcompose.metrics.table).
DENSE_FROM_WORKERS = 8

# Latencies kept unbucketed before they are folded into the table; bounds the
# memory of a process whose stats nobody takes (vLLM takes them every step).
MAX_PENDING_CALLS = 1 << 16

_NO_COUNTS = [0] * len(COUNTERS)
_HITS, _MISSES, _MATCHED, _LOADED, _LOAD_ERRORS = (COUNTERS.index(name) for name in (
    "lookup_hits", "lookup_misses", "matched_tokens", "loaded_tokens", "load_error_blocks"))


def _count_lookup(counts: list[int], args: tuple[Any, ...], result: Any) -> None:
    tokens = result[0]
    if tokens is None:
        return
    if tokens > 0:
        counts[_HITS] += 1
        counts[_MATCHED] += tokens
    else:
        counts[_MISSES] += 1


def _count_loaded(counts: list[int], args: tuple[Any, ...], result: Any) -> None:
    counts[_LOADED] += args[2]


def _count_load_errors(counts: list[int], args: tuple[Any, ...], result: Any) -> None:
    counts[_LOAD_ERRORS] += len(result)


_RESULT_COUNTERS: dict[str, Callable[[list[int], tuple[Any, ...], Any], None]] = {
    "get_num_new_matched_tokens": _count_lookup,
    "update_state_after_alloc": _count_loaded,
    "get_block_ids_with_load_errors": _count_load_errors,
}


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
        self._bucketed: Cells = {}  # calls folded since the last take
        # Filled on the hot path, in place (wrappers hold references to them).
        self._slots: list[int] = []  # (child, op) of each call, as child * len(OPS) + op
        self._latencies: list[float] = []
        self._counts = [[0] * len(COUNTERS) for _ in self._children]
        self._errors: ErrorCounts = {}

    def wrap(self, child_name: str, operation: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call``, timed and counted; unwrapped when metrics are off, for operations
        outside ``OPERATION_LABELS`` and, unless ``per_layer``, the per-layer ones."""
        op = OPERATION_LABELS.get(operation) or (PER_LAYER_OPERATIONS.get(operation) if self.per_layer else None)
        if not self.enabled or op is None:
            return call
        row = self._children.index(child_name)
        slot = row * len(OPS) + OPS.index(op)
        counts = self._counts[row]
        count_result = _RESULT_COUNTERS.get(operation)
        slots, latencies = self._slots, self._latencies

        def observed(*args: Any, **kwargs: Any) -> Any:
            start = perf_counter()
            try:
                result = call(*args, **kwargs)
            except Exception as error:
                latencies.append(perf_counter() - start)
                slots.append(slot)
                self._count_error(child_name, op, type(error).__name__)
                raise
            latencies.append(perf_counter() - start)
            slots.append(slot)
            if len(slots) >= MAX_PENDING_CALLS:
                self._fold()
            if count_result is not None:
                count_result(counts, args, result)
            return result

        observed.__wrapped__ = call  # type: ignore[attr-defined]
        return observed

    def count_load_errors(self, child_name: str, blocks: int) -> None:
        """Blocks of a load kvcompose gave back to vLLM after the child failed."""
        if self.enabled:
            self._counts[self._children.index(child_name)][_LOAD_ERRORS] += blocks

    def take(self) -> CallTable | None:
        """The calls since the last take (None if there were none), then start afresh."""
        if not (self._slots or self._bucketed or self._errors or any(map(any, self._counts))):
            return None
        self._fold()
        counters = [count for child_counts in self._counts for count in child_counts]
        table = CallTable(self._children, len(self._bounds) + 1, self._bucketed, counters, self._errors)
        self._bucketed, self._errors = {}, {}
        for child_counts in self._counts:
            child_counts[:] = _NO_COUNTS
        if self._ship_dense:
            table.densify()
        return table

    def _count_error(self, child_name: str, op: str, error_type: str) -> None:
        by_type = self._errors.setdefault(child_name, {}).setdefault(op, {})
        by_type[error_type] = by_type.get(error_type, 0) + 1

    def _fold(self) -> None:
        """Sort the pending latencies into their cells, for the next take."""
        bucket_latencies(self._slots, self._latencies, self._bounds, into=self._bucketed)
        self._slots.clear()
        self._latencies.clear()


def bucket_latencies(slots: Sequence[int], latencies: Sequence[float], bounds: Sequence[float], into: Cells) -> None:
    """Count each latency, and add it up, in the cell of its slot and bucket: bucket ``i`` holds
    ``bounds[i-1] < v <= bounds[i]`` (Prometheus' ``le``), the last one the rest."""
    buckets = len(bounds) + 1
    for slot, latency in zip(slots, latencies, strict=True):
        cell = slot * buckets + bisect_left(bounds, latency)
        if (entry := into.get(cell)) is None:
            into[cell] = [1, latency]
        else:
            entry[0] += 1
            entry[1] += latency
