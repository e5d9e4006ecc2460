"""Per-transfer stats: each child's KV loads and saves, one transfer at a time, and its engine wait.

A transfer is one load or save of a request's KV by one child, from the step
that issues it to the moment the engine learns it is done, failed or aborted
(see kvcompose.instrumentation.transfers). The process's
:class:`TransferRecorder` hears of each start and end; vLLM takes its
:class:`TransferTable` with the step's stats, merges the tables of the
workers and the scheduler, and hands the sum to the front-end.

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

import threading
import time
from bisect import bisect_left
from collections.abc import Sequence
from operator import add
from typing import Any

from kvcompose.metrics.table import Cells, add_cells
from kvcompose.operations import DIRECTIONS, Direction, Outcome

# The outcomes counted as failures, in the order a table keeps them.
FAILURES: tuple[Outcome, ...] = ("failed", "aborted")

# Duration cell -> [unix time, trace id, seconds]: in that order, the later of two exemplars
# compares greater (ties broken by trace id and seconds, so any merge order keeps the same one).
Exemplars = dict[int, list[Any]]

_DIRECTION_INDEX = {direction: index for index, direction in enumerate(DIRECTIONS)}
_FAILURE_INDEX = {outcome: index for index, outcome in enumerate(FAILURES)}


class TransferTable:
    """Every child's transfers since the last report, by lane (child and direction)."""

    def __init__(
        self, children: Sequence[str], buckets: int, cells: Cells | None = None, copy_cells: Cells | None = None,
        moved_bytes: list[int] | None = None, in_flight: list[int] | None = None, failures: list[int] | None = None,
        waited: list[float] | None = None, exemplars: Exemplars | None = None, copied_bytes: list[int] | None = None,
    ) -> None:
        self.children = tuple(children)
        self.buckets = buckets
        lanes = len(self.children) * len(DIRECTIONS)
        self.cells: Cells = cells if cells is not None else {}  # lifetime: lane * buckets + bucket -> [transfers, s]
        self.copy_cells: Cells = copy_cells if copy_cells is not None else {}  # copy time, the same cells
        self.moved_bytes = moved_bytes if moved_bytes is not None else [0] * lanes
        self.copied_bytes = copied_bytes if copied_bytes is not None else [0] * lanes  # of those in copy_cells
        self.in_flight = in_flight if in_flight is not None else [0] * lanes  # started less ended
        self.failures = failures if failures is not None else [0] * (lanes * len(FAILURES))
        self.waited = waited if waited is not None else [0.0] * lanes  # engine wait, seconds
        self.exemplars: Exemplars = exemplars if exemplars is not None else {}

    def lane(self, index: int) -> tuple[str, Direction]:
        """The (child, direction) of lane ``index``."""
        row, column = divmod(index, len(DIRECTIONS))
        return self.children[row], DIRECTIONS[column]

    def add(self, other: TransferTable) -> None:
        """Add ``other``'s transfers into this table (``other`` is not modified)."""
        if other.children != self.children or other.buckets != self.buckets:
            raise ValueError(
                f"kvcompose: cannot merge transfer tables of different pipelines ({self.children} with "
                f"{self.buckets} buckets, {other.children} with {other.buckets})"
            )
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

    def _lane_index(self, child: str, direction: Direction) -> int:
        return self.children.index(child) * len(DIRECTIONS) + _DIRECTION_INDEX[direction]

    def _lane_totals(self, cells: Cells, child: str, direction: Direction) -> tuple[int, float]:
        first = self._lane_index(child, direction) * self.buckets
        counted = [entry for cell, entry in cells.items() if first <= cell < first + self.buckets]
        return sum(count for count, _ in counted), sum(seconds for _, seconds in counted)

    def transfers(self, child: str, direction: Direction) -> int:
        """Transfers that ended, whatever their outcome."""
        return self._lane_totals(self.cells, child, direction)[0]

    def copy_seconds(self, child: str, direction: Direction) -> tuple[int, float]:
        """(transfers with a copy time, their copy seconds)."""
        return self._lane_totals(self.copy_cells, child, direction)

    def failed(self, child: str, direction: Direction, outcome: Outcome) -> int:
        return self.failures[self._lane_index(child, direction) * len(FAILURES) + _FAILURE_INDEX[outcome]]

    def bytes_moved(self, child: str, direction: Direction) -> int:
        return self.moved_bytes[self._lane_index(child, direction)]

    def bytes_copied(self, child: str, direction: Direction) -> int:
        """Bytes of the transfers with a copy time (those :meth:`copy_seconds` counts)."""
        return self.copied_bytes[self._lane_index(child, direction)]

    def in_flight_change(self, child: str, direction: Direction) -> int:
        return self.in_flight[self._lane_index(child, direction)]

    def engine_wait(self, child: str, direction: Direction) -> float:
        return self.waited[self._lane_index(child, direction)]

    def reduce(self) -> dict[str, int | float]:
        """Transfers, mean ms, bytes, engine wait and failures per child and direction, for vLLM's periodic log."""
        totals: dict[int, list[Any]] = {}  # lane -> [transfers, seconds]
        for cell, (count, seconds) in self.cells.items():
            lane_total = totals.setdefault(cell // self.buckets, [0, 0.0])
            lane_total[0] += count
            lane_total[1] += seconds
        reduced: dict[str, int | float] = {}
        for lane in range(len(self.moved_bytes)):
            child, direction = self.lane(lane)
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
            "buckets": self.buckets, "cells": _cells_to_dict(self.cells), "copy": _cells_to_dict(self.copy_cells),
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
        return cls(data["children"], data["buckets"], _cells_from_dict(data["cells"]),
                   _cells_from_dict(data["copy"]), list(data["bytes"]), list(data["in_flight"]),
                   list(data["failures"]), list(data["waited"]), exemplars, list(data["copied_bytes"]))

    def copy(self) -> TransferTable:
        """A table of its own with this one's transfers."""
        copy = TransferTable(self.children, self.buckets)
        copy.add(self)
        return copy

    @classmethod
    def from_payload(cls, payload: TransferTable | dict[str, Any]) -> TransferTable:
        """The table itself, or rebuilt from its dict after a process hop."""
        return payload if isinstance(payload, TransferTable) else cls.from_dict(payload)


def _cells_to_dict(cells: Cells) -> dict[str, list[Any]]:
    return {"cells": list(cells), "transfers": [entry[0] for entry in cells.values()],
            "seconds": [entry[1] for entry in cells.values()]}


def _cells_from_dict(data: dict[str, list[Any]]) -> Cells:
    return {cell: [count, seconds] for cell, count, seconds in
            zip(data["cells"], data["transfers"], data["seconds"], strict=True)}


class TransferRecorder:
    """This process's transfers since the last :meth:`take`; records nothing when metrics are off.

    ``started``, ``ended`` and ``waited`` append their entries (atomic, so any thread may call them: a child may
    report a transfer done from its own); :meth:`take` copies them out under a lock and folds them into a
    :class:`TransferTable`.
    """

    def __init__(self, enabled: bool, child_names: Sequence[str], bounds: Sequence[float]) -> None:
        self.enabled = enabled
        self._children = tuple(child_names)
        self._bounds = tuple(bounds)
        self._buckets = len(self._bounds) + 1
        self._lock = threading.Lock()
        # Filled in place: a lane (a transfer started), (lane, seconds) (engine wait), or (lane, lifetime,
        # copy or None, bytes, failure index or -1, exemplar or None) (a transfer ended).
        self._events: list[Any] = []

    def started(self, child: int, direction: Direction) -> None:
        """Child ``child`` (its index in the pipeline) began a transfer."""
        if self.enabled:
            self._events.append(child * len(DIRECTIONS) + _DIRECTION_INDEX[direction])

    def waited(self, child: int, direction: Direction, seconds: float) -> None:
        """The forward pass spent ``seconds`` inside child ``child``'s blocking calls of ``direction``."""
        if self.enabled:
            self._events.append((child * len(DIRECTIONS) + _DIRECTION_INDEX[direction], seconds))

    def ended(
        self, child: int, direction: Direction, lifetime_s: float, copy_s: float | None, nbytes: int,
        outcome: Outcome, trace_id: str | None,
    ) -> None:
        """A transfer of child ``child`` ended after ``lifetime_s``, having moved ``nbytes`` (whatever the outcome:
        pass what moved) in ``copy_s`` (None: unknown; else its bytes also count as copied). ``trace_id`` (32 hex
        digits), when it was traced, becomes its lifetime bucket's exemplar."""
        if self.enabled:
            lane = child * len(DIRECTIONS) + _DIRECTION_INDEX[direction]
            failure = -1 if outcome == "ok" else lane * len(FAILURES) + _FAILURE_INDEX[outcome]
            exemplar = [time.time(), trace_id, lifetime_s] if trace_id else None
            self._events.append((lane, lifetime_s, copy_s, nbytes, failure, exemplar))

    def take(self) -> TransferTable | None:
        """The transfers since the last take, then start afresh; None if nothing happened."""
        if not self._events:
            return None
        table = TransferTable(self._children, self._buckets)
        with self._lock:
            events = self._events[:]
            del self._events[: len(events)]  # what other threads append meanwhile stays for the next take
        for event in events:
            if type(event) is int:
                table.in_flight[event] += 1
            elif len(event) == 2:
                table.waited[event[0]] += event[1]
            else:
                lane, lifetime_s, copy_s, nbytes, failure, exemplar = event
                table.in_flight[lane] -= 1
                cell = self._add(table.cells, lane, lifetime_s)
                if copy_s is not None:
                    self._add(table.copy_cells, lane, copy_s)
                    table.copied_bytes[lane] += nbytes
                table.moved_bytes[lane] += nbytes
                if failure >= 0:
                    table.failures[failure] += 1
                if exemplar is not None:
                    table.exemplars[cell] = exemplar
        return table

    def _add(self, cells: Cells, lane: int, seconds: float) -> int:
        """One transfer of ``seconds`` into the lane's cells; returns its cell."""
        cell = lane * self._buckets + bisect_left(self._bounds, seconds)  # Prometheus' le: bound inclusive
        if (entry := cells.get(cell)) is None:
            cells[cell] = [1, seconds]
        else:
            entry[0] += 1
            entry[1] += seconds
        return cell
