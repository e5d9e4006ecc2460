"""TransferTable: each child's KV loads and saves since the last report, as the stats carry them.

A transfer is one load or save of a request's KV by one child, from the step
that issues it to the moment the engine learns it is done, failed or aborted
(see kvcompose.instrumentation.transfers). vLLM takes a process's table with
the stats of the steps that report (kvcompose.instrumentation.scheduler),
merges the tables of the workers and the scheduler, and hands the sum to the
front-end.

A table holds, per lane (one child and one direction):

- lifetime cells, one per histogram bucket: transfers and summed seconds, so
  Prometheus gets exact bucket counts and an exact ``_sum``; and copy cells
  alike, for the transfers whose copy time is known;
- the bytes moved, and the bytes of the transfers whose copy time is known
  (so that bytes over copy seconds is a throughput);
- the change in transfers in flight (started less ended): the front-end adds
  the changes up into its gauge;
- the transfers that failed or were aborted;
- the seconds the forward pass spent inside the child's blocking calls
  (engine wait);
- per lifetime cell, the latest transfer with a trace id (its time, id and
  seconds), the exemplar that links a slow bucket to its trace.

So its size is bounded by the pipeline (children x 2 x buckets), whatever the
traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import add
from typing import Any

from kvcompose.operations import DIRECTIONS, Direction, Outcome
from kvcompose.wire.grid import Cells, Grid, add_cells, cells_from_dict, cells_to_dict

# The outcomes counted as failures, in the order a table keeps them.
FAILURES: tuple[Outcome, ...] = ("failed", "aborted")

# Duration cell -> [unix time, trace id, seconds]: in that order, the later of two exemplars
# compares greater (ties broken by trace id and seconds, so any merge order keeps the same one).
Exemplars = dict[int, list[Any]]

_FAILURE_INDEX = {outcome: index for index, outcome in enumerate(FAILURES)}


class TransferTable(Grid):
    """Every child's transfers since the last report, by lane (child and direction)."""

    COLUMNS = DIRECTIONS
    WHAT = "transfer"

    def __init__(
        self, children: Sequence[str], buckets: int, cells: Cells | None = None, copy_cells: Cells | None = None,
        moved_bytes: list[int] | None = None, in_flight: list[int] | None = None, failures: list[int] | None = None,
        waited: list[float] | None = None, exemplars: Exemplars | None = None, copied_bytes: list[int] | None = None,
    ) -> None:
        super().__init__(children, buckets)
        lanes = len(self.children) * len(DIRECTIONS)
        self.cells: Cells = cells if cells is not None else {}  # lifetime: lane * buckets + bucket -> [transfers, s]
        self.copy_cells: Cells = copy_cells if copy_cells is not None else {}  # copy time, the same cells
        self.moved_bytes = moved_bytes if moved_bytes is not None else [0] * lanes
        self.copied_bytes = copied_bytes if copied_bytes is not None else [0] * lanes  # of those in copy_cells
        self.in_flight = in_flight if in_flight is not None else [0] * lanes  # started less ended
        self.failures = failures if failures is not None else [0] * (lanes * len(FAILURES))
        self.waited = waited if waited is not None else [0.0] * lanes  # engine wait, seconds
        self.exemplars: Exemplars = exemplars if exemplars is not None else {}

    def add(self, other: TransferTable) -> None:
        self.check_mergeable(other)
        add_cells(self.cells, other.cells)
        add_cells(self.copy_cells, other.copy_cells)
        self.moved_bytes = list(map(add, self.moved_bytes, other.moved_bytes))
        self.copied_bytes = list(map(add, self.copied_bytes, other.copied_bytes))
        self.in_flight = list(map(add, self.in_flight, other.in_flight))
        self.failures = list(map(add, self.failures, other.failures))
        self.waited = list(map(add, self.waited, other.waited))
        for cell, exemplar in other.exemplars.items():
            mine = self.exemplars.get(cell)
            if mine is None or exemplar > mine:
                self.exemplars[cell] = exemplar  # exemplars are replaced, never changed: sharing is safe

    def is_empty(self) -> bool:
        return not (self.cells or any(self.moved_bytes) or any(self.in_flight) or any(self.failures)
                    or any(self.waited))

    # ---- reading one lane ----

    def transfers(self, child: str, direction: Direction) -> int:
        """Transfers that ended, whatever their outcome."""
        return self.totals(self.cells, child, direction)[0]

    def copy_seconds(self, child: str, direction: Direction) -> tuple[int, float]:
        """(transfers with a copy time, their copy seconds)."""
        return self.totals(self.copy_cells, child, direction)

    def failed(self, child: str, direction: Direction, outcome: Outcome) -> int:
        return self.failures[self.position(child, direction) * len(FAILURES) + _FAILURE_INDEX[outcome]]

    def bytes_moved(self, child: str, direction: Direction) -> int:
        return self.moved_bytes[self.position(child, direction)]

    def bytes_copied(self, child: str, direction: Direction) -> int:
        """Bytes of the transfers with a copy time (those :meth:`copy_seconds` counts)."""
        return self.copied_bytes[self.position(child, direction)]

    def in_flight_change(self, child: str, direction: Direction) -> int:
        return self.in_flight[self.position(child, direction)]

    def engine_wait(self, child: str, direction: Direction) -> float:
        return self.waited[self.position(child, direction)]

    def reduce(self) -> dict[str, int | float]:
        """Transfers, mean ms, bytes, engine wait and failures per child and direction, for vLLM's periodic log."""
        totals: dict[int, list[Any]] = {}  # lane -> [transfers, seconds]
        for cell, (count, seconds) in self.cells.items():
            lane_total = totals.setdefault(cell // self.buckets, [0, 0.0])
            lane_total[0] += count
            lane_total[1] += seconds
        reduced: dict[str, int | float] = {}
        for lane in range(len(self.moved_bytes)):
            child, direction = self.at(lane)
            count, seconds = totals.get(lane, (0, 0.0))
            failures = self.failures[lane * len(FAILURES):(lane + 1) * len(FAILURES)]
            if not (count or self.moved_bytes[lane] or any(failures) or self.waited[lane]):
                continue
            prefix = f"{child}.{direction}"
            reduced[f"{prefix}.transfers"] = count
            if count:
                reduced[f"{prefix}.mean_ms"] = round(1000 * seconds / count, 4)
            reduced[f"{prefix}.bytes"] = self.moved_bytes[lane]
            if self.waited[lane]:
                reduced[f"{prefix}.engine_wait_ms"] = round(1000 * self.waited[lane], 4)
            for outcome, failed in zip(FAILURES, failures, strict=True):
                if failed:
                    reduced[f"{prefix}.{outcome}"] = failed
        return reduced

    # ---- crossing processes as plain data ----

    def to_dict(self) -> dict[str, Any]:
        return {
            "children": list(self.children), "directions": list(DIRECTIONS), "failure_outcomes": list(FAILURES),
            "buckets": self.buckets, "cells": cells_to_dict(self.cells), "copy": cells_to_dict(self.copy_cells),
            "bytes": list(self.moved_bytes), "in_flight": list(self.in_flight), "failures": list(self.failures),
            "waited": list(self.waited), "copied_bytes": list(self.copied_bytes),
            "exemplars": [[cell, *exemplar] for cell, exemplar in self.exemplars.items()],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransferTable:
        if tuple(data["directions"]) != DIRECTIONS or tuple(data["failure_outcomes"]) != FAILURES:
            raise ValueError(
                "kvcompose: transfer stats from a different kvcompose version (directions or outcomes differ); "
                "run one kvcompose version across the engine and its front-end"
            )
        exemplars = {cell: [at, trace_id, seconds] for cell, at, trace_id, seconds in data["exemplars"]}
        return cls(data["children"], data["buckets"], cells_from_dict(data["cells"]),
                   cells_from_dict(data["copy"]), list(data["bytes"]), list(data["in_flight"]),
                   list(data["failures"]), list(data["waited"]), exemplars, list(data["copied_bytes"]))
