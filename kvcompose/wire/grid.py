"""The grid both of kvcompose's stats tables are made of: the calls (kvcompose.wire.calls) and the transfers
(kvcompose.wire.transfers).

A row per child, a column per operation (calls) or direction (transfers),
and per row and column one cell per histogram bucket, the last one +Inf.
Each cell used holds its count and summed seconds, so the front-end can
replay exact bucket counts and the exact ``_sum`` into a Prometheus histogram
with the same bounds. The grid depends on the pipeline only, so a table is
never larger than it, whatever the traffic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any, ClassVar, Self

Cells = dict[int, list[Any]]  # cell index -> [count, seconds]


def add_cells(into: Cells, cells: Cells) -> None:
    """Add each cell's count and seconds into ``into`` (``cells`` is not modified)."""
    for cell, (count, total) in cells.items():
        if (mine := into.get(cell)) is None:
            into[cell] = [count, total]
        else:
            mine[0] += count
            mine[1] += total


def observe(cells: Cells, position: int, bounds: Sequence[float], seconds: float) -> int:
    """One observation of ``seconds`` into the cells of ``position`` (a row and column); returns its cell."""
    cell = position * (len(bounds) + 1) + bisect_left(bounds, seconds)  # Prometheus' le: the bound is inclusive
    if (entry := cells.get(cell)) is None:
        cells[cell] = [1, seconds]
    else:
        entry[0] += 1
        entry[1] += seconds
    return cell


def cells_to_dict(cells: Cells) -> dict[str, list[Any]]:
    return {"cells": list(cells), "counts": [entry[0] for entry in cells.values()],
            "seconds": [entry[1] for entry in cells.values()]}


def cells_from_dict(data: dict[str, list[Any]]) -> Cells:
    return {cell: [count, seconds] for cell, count, seconds in
            zip(data["cells"], data["counts"], data["seconds"], strict=True)}


class Grid(ABC):
    """What the calls table and the transfers table share: their rows, columns and buckets, and their cells'
    positions."""

    COLUMNS: ClassVar[tuple[str, ...]]  # the operations' labels, or the directions
    WHAT: ClassVar[str]  # what the table counts, for messages

    def __init__(self, children: Sequence[str], buckets: int) -> None:
        self.children = tuple(children)
        self.buckets = buckets

    def check_mergeable(self, other: Grid) -> None:
        if other.children != self.children or other.buckets != self.buckets:
            raise ValueError(
                f"kvcompose: cannot merge {self.WHAT} tables of different pipelines ({self.children} with "
                f"{self.buckets} buckets, {other.children} with {other.buckets})"
            )

    def position(self, child: str, column: str) -> int:
        """The row and column of ``child`` and ``column``, as one index."""
        return self.children.index(child) * len(self.COLUMNS) + self.COLUMNS.index(column)

    def at(self, position: int) -> tuple[str, str]:
        """The (child, column) of a position."""
        row, column = divmod(position, len(self.COLUMNS))
        return self.children[row], self.COLUMNS[column]

    def totals(self, cells: Cells, child: str, column: str) -> tuple[int, float]:
        """(count, seconds) of ``child`` and ``column`` over every bucket of ``cells``."""
        first = self.position(child, column) * self.buckets
        counted = [entry for cell, entry in cells.items() if first <= cell < first + self.buckets]
        return sum(count for count, _ in counted), sum(seconds for _, seconds in counted)

    @abstractmethod
    def add(self, other: Self) -> None:
        """Add ``other``'s counts into this table (``other`` is not modified)."""

    def copy(self) -> Self:
        """A table of its own with this one's counts."""
        copy = type(self)(self.children, self.buckets)
        copy.add(self)
        return copy

    @classmethod
    @abstractmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The table, from its ``to_dict``."""

    @classmethod
    def from_payload(cls, payload: Self | dict[str, Any]) -> Self:
        """The table itself, or rebuilt from its dict after a process hop."""
        return payload if isinstance(payload, cls) else cls.from_dict(payload)
