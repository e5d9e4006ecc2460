"""TransferRecorder: this process's transfers, as the transfer tracker tells them, folded into TransferTables.

A table's contents are described in kvcompose.wire.transfers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from kvcompose.operations import DIRECTIONS, Direction, Outcome
from kvcompose.wire.grid import observe
from kvcompose.wire.transfers import FAILURES, TransferTable

_DIRECTION_INDEX = {direction: index for index, direction in enumerate(DIRECTIONS)}
_FAILURE_INDEX = {outcome: index for index, outcome in enumerate(FAILURES)}


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
        table = TransferTable(self._children, len(self._bounds) + 1)
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
                cell = observe(table.cells, lane, self._bounds, lifetime_s)
                if copy_s is not None:
                    observe(table.copy_cells, lane, self._bounds, copy_s)
                    table.copied_bytes[lane] += nbytes
                table.moved_bytes[lane] += nbytes
                if failure >= 0:
                    table.failures[failure] += 1
                if exemplar is not None:
                    table.exemplars[cell] = exemplar
        return table
