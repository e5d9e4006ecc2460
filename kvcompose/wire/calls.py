"""CallTable: every child's calls since the last report, in the cells of a grid (kvcompose.wire.grid).

A cell is one (child, operation, latency bucket), with its call count and
summed seconds. ``counters`` count what the calls meant
(lookup hits, tokens), per child. Errors, rare and keyed by exception type,
are kept apart.

Blocks that failed to load are kept as block ids per child and scheduler step,
not as counts: with tensor parallelism every worker reports the blocks of a
load that failed on it, and vLLM recomputes the union of the workers' blocks
(``KVOutputAggregator``). Merging tables takes the same union per child and
step, so a block counts once, whichever workers reported it; keying by step
keeps a block that fails again in a later step (block ids are reused) counted
again, whatever tables are merged.

A step uses a few cells: they are kept sparse, in
plain Python, as that is what costs least on an engine step. Merging many
large tables (64 workers of 16 children) goes through a dense array of the
whole grid instead: the workers of a large engine ship their tables dense
(:meth:`CallTable.densify`, paid in parallel in each worker), and the
scheduler adds them up in one array operation each.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import add
from typing import Any

import numpy as np

from kvcompose.operations import TIMED_LABELS
from kvcompose.wire.grid import Cells, Grid, add_cells, cells_from_dict, cells_to_dict

# The operations recorded, as Prometheus' ``op`` label names them (see kvcompose.operations).
OPS: tuple[str, ...] = TIMED_LABELS
COUNTERS: tuple[str, ...] = ("lookup_hits", "lookup_misses", "matched_tokens", "loaded_tokens", "forgone_tokens")

# A merge that would leave more cells than this adds dense arrays instead.
SPARSE_MERGE_LIMIT = 256

ErrorCounts = dict[str, dict[str, dict[str, int]]]  # child -> op -> exception type -> calls
LoadErrors = dict[str, dict[int, set[int]]]  # child -> scheduler step -> ids of the blocks that failed to load


class CallTable(Grid):
    COLUMNS = OPS
    WHAT = "call"

    def __init__(
        self, children: Sequence[str], buckets: int, cells: Cells | None = None, counters: list[int] | None = None,
        errors: ErrorCounts | None = None, load_errors: LoadErrors | None = None,
    ) -> None:
        super().__init__(children, buckets)
        self._cells: Cells = cells if cells is not None else {}
        self._dense: np.ndarray | None = None  # [cell] -> (calls, seconds), while merging many tables
        self.counters = counters if counters is not None else [0] * (len(self.children) * len(COUNTERS))
        self.errors: ErrorCounts = errors if errors is not None else {}
        self.load_errors: LoadErrors = load_errors if load_errors is not None else {}

    @property
    def cells(self) -> Cells:
        """The cells used: index -> [calls, seconds]."""
        if self._dense is not None:
            used = np.flatnonzero(self._dense[:, 0])
            self._cells = {cell: [int(count), total] for cell, (count, total) in
                           zip(used.tolist(), self._dense[used].tolist(), strict=True)}
            self._dense = None
        return self._cells

    def densify(self) -> None:
        """Hold the cells as one array of the whole grid: bigger, but added up in one operation."""
        if self._dense is None:
            # float64 counts are exact to 2**53 calls.
            self._dense = np.zeros((len(self.children) * len(OPS) * self.buckets, 2), np.float64)
            self._add_sparse_to_dense(self._cells)
            self._cells = {}

    def add(self, other: CallTable) -> None:
        self.check_mergeable(other)
        if other._dense is not None:
            self.densify()
            self._dense += other._dense
        elif self._dense is None and len(self._cells) + len(other._cells) <= SPARSE_MERGE_LIMIT:
            add_cells(self._cells, other._cells)
        else:
            self.densify()
            self._add_sparse_to_dense(other._cells)
        self.counters = list(map(add, self.counters, other.counters))
        for child, by_op in other.errors.items():
            mine_by_op = self.errors.setdefault(child, {})
            for op, by_type in by_op.items():
                counts = mine_by_op.setdefault(op, {})
                for error_type, count in by_type.items():
                    counts[error_type] = counts.get(error_type, 0) + count
        for child, by_step in other.load_errors.items():
            mine_by_step = self.load_errors.setdefault(child, {})
            for step, block_ids in by_step.items():
                mine_by_step.setdefault(step, set()).update(block_ids)

    def _add_sparse_to_dense(self, cells: Cells) -> None:
        if cells:
            assert self._dense is not None
            used = np.fromiter(cells.keys(), np.int64, len(cells))
            self._dense[used] += list(cells.values())  # each cell appears once, so plain indexing adds correctly

    def is_empty(self) -> bool:
        return not (self.errors or self.load_errors or any(self.counters) or self.cells)

    # ---- reading one child ----

    def call_count(self, child: str, op: str) -> int:
        return self.totals(self.cells, child, op)[0]

    def counter(self, child: str, name: str) -> int:
        return self.counters[self.children.index(child) * len(COUNTERS) + COUNTERS.index(name)]

    def load_error_blocks(self, child: str) -> int:
        """Blocks the child failed to load: each block once per step, whichever workers reported it."""
        return sum(map(len, self.load_errors.get(child, {}).values()))

    def operation_of(self, cell: int) -> tuple[str, str]:
        """The (child, op) a cell counts calls of."""
        return self.at(cell // self.buckets)

    def by_operation(self) -> dict[tuple[str, str], tuple[int, float]]:
        """(child, op) -> (calls, seconds), over every bucket, for the operations called."""
        totals: dict[tuple[str, str], tuple[int, float]] = {}
        for cell, (count, seconds) in self.cells.items():
            key = self.operation_of(cell)
            calls_so_far, seconds_so_far = totals.get(key, (0, 0.0))
            totals[key] = (calls_so_far + count, seconds_so_far + seconds)
        return totals

    def reduce(self) -> dict[str, int | float]:
        """Calls and mean ms per child and operation, plus lookup counters, for vLLM's periodic log."""
        reduced: dict[str, int | float] = {}
        for child in self.children:
            for name in ("lookup_hits", "lookup_misses", "loaded_tokens"):
                reduced[f"{child}.{name}"] = self.counter(child, name)
        for (child, op), (count, seconds) in sorted(self.by_operation().items()):
            reduced[f"{child}.{op}.calls"] = count
            reduced[f"{child}.{op}.mean_ms"] = round(1000 * seconds / count, 4)
        return reduced

    # ---- crossing processes as plain data ----

    def to_dict(self) -> dict[str, Any]:
        return {"children": list(self.children), "ops": list(OPS), "counter_names": list(COUNTERS),
                "buckets": self.buckets, "cells": cells_to_dict(self.cells), "counters": list(self.counters),
                "errors": self.errors,
                "load_errors": {child: [[step, sorted(block_ids)] for step, block_ids in sorted(by_step.items())]
                                for child, by_step in self.load_errors.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CallTable:
        if tuple(data["ops"]) != OPS or tuple(data["counter_names"]) != COUNTERS:
            raise ValueError(
                "kvcompose: stats from a different kvcompose version (operations or counters differ); "
                "run one kvcompose version across the engine and its front-end"
            )
        errors = {child: {op: dict(by_type) for op, by_type in by_op.items()} for child, by_op in data["errors"].items()}
        load_errors = {child: {step: set(block_ids) for step, block_ids in by_step}
                       for child, by_step in data["load_errors"].items()}
        return cls(data["children"], data["buckets"], cells_from_dict(data["cells"]), list(data["counters"]), errors,
                   load_errors)
