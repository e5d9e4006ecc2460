"""CallTable: every child's calls since the last report, in one fixed-shape block.

``calls[child, op, bucket]`` counts calls by latency bucket (the last bucket
is +Inf) and ``seconds`` holds the same cells' summed latencies, so the
front-end can replay exact bucket counts and the exact ``_sum`` into any
Prometheus histogram with the same bounds. ``counters[child, counter]``
counts what the calls meant (lookup hits, tokens). Errors, rare and keyed by
exception type, are kept sparse.

The shape depends on the pipeline only, never on the traffic, and merging the
tables of 64 workers is a few array additions each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The operations recorded, as Prometheus' ``op`` label names them. The last two
# run once per layer per step and are recorded only with ``metrics.per_layer``.
OPS: tuple[str, ...] = (
    "lookup", "update_state_after_alloc", "build_connector_meta", "request_finished", "start_load_kv",
    "wait_for_save", "get_transfer_results", "get_block_ids_with_load_errors", "wait_for_layer_load",
    "save_kv_layer",
)  # fmt: skip
COUNTERS: tuple[str, ...] = ("lookup_hits", "lookup_misses", "matched_tokens", "loaded_tokens", "load_error_blocks")

ErrorCounts = dict[str, dict[str, dict[str, int]]]  # child -> op -> exception type -> calls


@dataclass
class CallTable:
    children: tuple[str, ...]
    calls: np.ndarray  # int64 [child, op, bucket]
    seconds: np.ndarray  # float64 [child, op, bucket]
    counters: np.ndarray  # int64 [child, counter]
    errors: ErrorCounts = field(default_factory=dict)

    @classmethod
    def zeros(cls, children: Sequence[str], buckets: int) -> CallTable:
        shape = (len(children), len(OPS), buckets)
        return cls(tuple(children), np.zeros(shape, np.int64), np.zeros(shape, np.float64),
                   np.zeros((len(children), len(COUNTERS)), np.int64))

    def add(self, other: CallTable) -> None:
        """Add ``other``'s counts into this table (``other`` is not modified)."""
        if other.children != self.children or other.calls.shape != self.calls.shape:
            raise ValueError(
                f"kvcompose: cannot merge call tables of different pipelines ({self.children} with "
                f"{self.calls.shape[-1]} buckets, {other.children} with {other.calls.shape[-1]})"
            )
        self.calls += other.calls
        self.seconds += other.seconds
        self.counters += other.counters
        for child, by_op in other.errors.items():
            mine = self.errors.setdefault(child, {})
            for op, by_type in by_op.items():
                counts = mine.setdefault(op, {})
                for error_type, count in by_type.items():
                    counts[error_type] = counts.get(error_type, 0) + count

    def is_empty(self) -> bool:
        return not (self.errors or self.calls.any() or self.counters.any())

    # ---- reading one child ----

    def call_count(self, child: str, op: str) -> int:
        return int(self.calls[self.children.index(child), OPS.index(op)].sum())

    def counter(self, child: str, name: str) -> int:
        return int(self.counters[self.children.index(child), COUNTERS.index(name)])

    def reduce(self) -> dict[str, int | float]:
        """Calls and mean ms per child and operation, plus lookup counters, for vLLM's periodic log."""
        reduced: dict[str, int | float] = {}
        calls, seconds = self.calls.sum(axis=2), self.seconds.sum(axis=2)
        for row, child in enumerate(self.children):
            for name in ("lookup_hits", "lookup_misses", "loaded_tokens"):
                reduced[f"{child}.{name}"] = int(self.counters[row, COUNTERS.index(name)])
            for column, op in enumerate(OPS):
                if count := int(calls[row, column]):
                    reduced[f"{child}.{op}.calls"] = count
                    reduced[f"{child}.{op}.mean_ms"] = round(1000 * float(seconds[row, column]) / count, 4)
        return reduced

    # ---- crossing processes as plain data ----

    def to_dict(self) -> dict[str, Any]:
        """Plain data; the latency cells travel sparse (flat index, calls, seconds), as most stay empty."""
        cells = np.flatnonzero(self.calls)
        return {"children": list(self.children), "ops": list(OPS), "counter_names": list(COUNTERS),
                "buckets": self.calls.shape[-1], "cells": cells.tolist(), "calls": self.calls.flat[cells].tolist(),
                "seconds": self.seconds.flat[cells].tolist(), "counters": self.counters.tolist(),
                "errors": self.errors}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CallTable:
        if tuple(data["ops"]) != OPS or tuple(data["counter_names"]) != COUNTERS:
            raise ValueError(
                "kvcompose: stats from a different kvcompose version (operations or counters differ); "
                "run one kvcompose version across the engine and its front-end"
            )
        table = cls.zeros(data["children"], data["buckets"])
        cells = np.asarray(data["cells"], np.int64)
        table.calls.flat[cells] = data["calls"]
        table.seconds.flat[cells] = data["seconds"]
        table.counters[:] = data["counters"]
        table.errors = {child: {op: dict(by_type) for op, by_type in by_op.items()}
                        for child, by_op in data["errors"].items()}
        return table
