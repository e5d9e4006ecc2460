"""Span outboxes: what a tracer appends is shipped once, in order, off the engine's thread."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

from kvcompose.tracing.outbox import Outbox, drain_for, force_flush

from .span_support import wait_until


class Collected:
    def __init__(self, fail_first: int = 0) -> None:
        self.batches: list[list[Any]] = []
        self._fail = fail_first

    def ship(self, records: Sequence[Any]) -> None:
        if self._fail:
            self._fail -= 1
            raise OSError("exporter gone")
        self.batches.append(list(records))

    @property
    def records(self) -> list[Any]:
        return [record for batch in self.batches for record in batch]


def test_records_appended_while_drains_run_are_each_shipped_once_in_order() -> None:
    """The engine's thread appends without a lock while drains take slices: nothing lost, nothing twice
    (shipping the outbox and then clearing it would lose what was appended during the ship)."""
    receiver = Collected()
    outbox = Outbox(receiver)
    count, done = 200_000, threading.Event()

    def drain_until_done() -> None:
        while not done.is_set():
            force_flush()

    drainer = threading.Thread(target=drain_until_done)
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns between almost any two operations
    try:
        drainer.start()
        append = outbox.append  # as the tracer's span runners hold it
        for index in range(count):
            append(index)
            if index == count // 2:  # a drain for sure mid-stream: a busy machine may not schedule the drainer
                wait_until(lambda: bool(receiver.batches))
        done.set()
        drainer.join()
    finally:
        sys.setswitchinterval(switch_interval)
    force_flush()

    assert receiver.records == list(range(count))
    assert len(receiver.batches) > 1  # the drains did run while records were appended
    assert len(outbox) == 0


def test_a_failing_shipper_loses_its_batch_and_the_next_ones_still_ship() -> None:
    receiver = Collected(fail_first=1)
    outbox = Outbox(receiver)
    outbox.append("lost")
    force_flush()
    outbox.append("kept")
    force_flush()

    assert receiver.batches == [["kept"]]


def test_draining_for_one_shipper_leaves_the_others_outboxes() -> None:
    closing, other = Collected(), Collected()
    closing_box, other_box = Outbox(closing), Outbox(other)
    closing_box.append("a")
    other_box.append("b")

    drain_for(closing)

    assert closing.records == ["a"] and other.records == [] and list(other_box) == ["b"]
