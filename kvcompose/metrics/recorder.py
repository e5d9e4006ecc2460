"""Per-process recording of every child call: latency, errors and what the call meant.

The composite asks :meth:`PipelineRecorder.wrap` to wrap each child operation
once, at start-up. A wrapped call costs two clock reads and two list appends;
latencies are sorted into buckets only when vLLM asks for the step's stats
(:meth:`PipelineRecorder.take`), all of them at once. For the operations in
``_RESULT_COUNTERS`` the wrapper also counts what the call meant (a lookup
hit or miss, tokens matched or loaded, blocks that failed to load).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

import numpy as np

from kvcompose.metrics.table import COUNTERS, OPS, CallTable, ErrorCounts

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
        self, enabled: bool, bounds: Sequence[float], child_names: Sequence[str], per_layer: bool = False
    ) -> None:
        self.enabled = enabled
        self.per_layer = per_layer
        self._children = tuple(child_names)
        self._bounds = np.asarray(bounds, np.float64)
        self._shape = (len(self._children), len(OPS), len(bounds) + 1)  # a CallTable's calls and seconds
        self._bucketed: tuple[np.ndarray, np.ndarray] | None = None  # (calls, seconds) folded since the last take
        # Filled on the hot path, in place (wrappers hold references to them).
        self._cells: list[int] = []  # (child, op) of each call, as child * len(OPS) + op
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
        cell = row * len(OPS) + OPS.index(op)
        counts = self._counts[row]
        count_result = _RESULT_COUNTERS.get(operation)
        cells, latencies = self._cells, self._latencies

        def observed(*args: Any, **kwargs: Any) -> Any:
            start = perf_counter()
            try:
                result = call(*args, **kwargs)
            except Exception as error:
                latencies.append(perf_counter() - start)
                cells.append(cell)
                self._count_error(child_name, op, type(error).__name__)
                raise
            latencies.append(perf_counter() - start)
            cells.append(cell)
            if len(cells) >= MAX_PENDING_CALLS:
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
        if not (self._cells or self._bucketed or self._errors or any(map(any, self._counts))):
            return None
        self._fold()
        calls, seconds = self._bucketed or (np.zeros(self._shape, np.int64), np.zeros(self._shape, np.float64))
        table = CallTable(self._children, calls, seconds, np.asarray(self._counts, np.int64), self._errors)
        self._bucketed, self._errors = None, {}
        for counts in self._counts:
            counts[:] = _NO_COUNTS
        return table

    def _count_error(self, child_name: str, op: str, error_type: str) -> None:
        by_type = self._errors.setdefault(child_name, {}).setdefault(op, {})
        by_type[error_type] = by_type.get(error_type, 0) + 1

    def _fold(self) -> None:
        """Sort the pending latencies into buckets, for the next take."""
        if not self._cells:
            return
        calls, seconds = bucket_latencies(self._cells, self._latencies, self._bounds, self._shape)
        self._cells.clear()
        self._latencies.clear()
        if self._bucketed is None:
            self._bucketed = calls, seconds
        else:
            folded_calls, folded_seconds = self._bucketed
            folded_calls += calls
            folded_seconds += seconds


def bucket_latencies(
    cells: Sequence[int], latencies: Sequence[float], bounds: np.ndarray, shape: tuple[int, int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Calls and summed seconds per (cell, bucket), bucket ``i`` holding ``bounds[i-1] < v <= bounds[i]``
    (Prometheus' ``le``) and the last one the rest."""
    values = np.asarray(latencies, np.float64)
    flat = np.asarray(cells, np.int64) * shape[-1] + np.searchsorted(bounds, values)
    size = shape[0] * shape[1] * shape[2]
    calls = np.bincount(flat, minlength=size).reshape(shape)
    return calls, np.bincount(flat, weights=values, minlength=size).reshape(shape)
