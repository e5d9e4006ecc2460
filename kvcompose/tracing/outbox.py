"""Where a tracer's span records wait to be shipped, and the thread that ships them.

A tracer appends each finished span's record to its :class:`Outbox` and does
nothing more on the engine's thread: no copy, no encoding, no system call, and
no decision about when to ship. One daemon thread per process (started with the
first outbox) takes every outbox's records each :data:`DRAIN_EVERY_S` and hands
them to the outbox's shipper (:mod:`kvcompose.tracing.shipping`), as
OpenTelemetry's ``BatchSpanProcessor`` does on its schedule. While its drains
find nothing, it backs off to :data:`IDLE_DRAIN_EVERY_S`: ten wake-ups a second
were most of what an idle tracing engine spent on tracing (``make bench``,
request_rate at 0 requests/s). :func:`force_flush` does the same at once (a
shipper closing, tests).

Shipping on the engine's thread would cost a ``marshal`` and a write to the
exporter's pipe at every worker step that moved a traced request's KV, and
whenever the scheduler's last request finished: on the path to that request's
first token, and once per request at low rates. The thread ships a tenth of a
second's records at once, off that path.

Between the two threads: the engine's thread only appends; a drain copies the
first ``n`` records (one slice) and deletes them (one ``del`` of that slice).
Each is a single list operation, atomic under the GIL (and under the
per-object locks of a free-threaded build), and appends only add at the end,
so no record is lost or shipped twice. Drains (the thread's and
:func:`force_flush`) hold one lock, so a shipper has one writer at a time.

Memory: an outbox holds at most the records of one drain interval (plus the
time a drain waits for the GIL): a backed-off one for the first records after
an idle spell, then :data:`DRAIN_EVERY_S`; a shipper that cannot keep up drops and
counts (:class:`~kvcompose.tracing.shipping.ProcessShipper`). A process killed
outright loses what its outboxes held, at most a drain interval's records.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from kvcompose.log_throttle import LogThrottle

DRAIN_EVERY_S = 0.1
IDLE_DRAIN_EVERY_S = 0.8  # backed off to, doubling, while drains find nothing
THREAD_NAME = "kvcompose-span-outbox"


class Receiver(Protocol):
    def ship(self, records: Sequence[Any]) -> None: ...


class Outbox(list):  # type: ignore[type-arg]
    """A tracer's finished span records (plain tuples), waiting for the drain; ``receiver`` ships them."""

    __slots__ = ("receiver", "__weakref__")

    def __init__(self, receiver: Receiver) -> None:
        super().__init__()
        self.receiver = receiver
        _DRAIN.register(self)


class _Drain:
    """The process's outboxes and the thread that empties them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outboxes: list[weakref.ref[Outbox]] = []
        self._thread: threading.Thread | None = None
        self._failures = LogThrottle(lines=1)  # a shipper failing every drain logs once a minute

    def register(self, outbox: Outbox) -> None:
        with self._lock:
            self._outboxes.append(weakref.ref(outbox))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        pause = DRAIN_EVERY_S
        while True:
            time.sleep(pause)
            pause = DRAIN_EVERY_S if self.drain() else min(2 * pause, IDLE_DRAIN_EVERY_S)

    def drain(self, receiver: Receiver | None = None) -> int:
        """Ship what every outbox holds (only those of ``receiver``, if given); the records shipped."""
        shipped = 0
        with self._lock:
            live = []
            for ref in self._outboxes:
                if (outbox := ref()) is None:
                    continue  # its tracer is gone (closed: drained then; dropped unclosed: what it held is lost)
                live.append(ref)
                if (receiver is None or outbox.receiver is receiver) and (count := len(outbox)):
                    records = outbox[:count]
                    del outbox[:count]
                    self._ship(outbox.receiver, records)
                    shipped += count
            self._outboxes = live
        return shipped

    def _ship(self, receiver: Receiver, records: list[Any]) -> None:
        try:
            receiver.ship(records)
        except Exception as error:  # a shipper that failed must not stop the thread, nor the next ships
            if self._failures.admit(error_type := type(error).__name__):
                from kvcompose.logs import get_logger

                get_logger("tracing").warning("span_ship_failed", spans_lost=len(records), error_type=error_type,
                                              exc_info=True)

    def forget(self) -> None:
        """In a forked child: the parent's outboxes and thread are not this process's."""
        self._lock = threading.Lock()
        self._outboxes, self._thread = [], None


_DRAIN = _Drain()
os.register_at_fork(after_in_child=_DRAIN.forget)


def force_flush() -> None:
    """Ship every outbox's records now (the thread does so each :data:`DRAIN_EVERY_S`)."""
    _DRAIN.drain()


def drain_for(receiver: Receiver) -> None:
    """Ship now the records of the outboxes ``receiver`` ships (it is about to close)."""
    _DRAIN.drain(receiver)
