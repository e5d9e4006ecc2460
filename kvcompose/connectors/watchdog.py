"""The watchdog: a call into a child that runs too long is seen while it runs.

vLLM calls a connector from one thread per process (the engine core's loop),
so a child that hangs stalls every request of the engine, and no Python call
can be interrupted: neither kvcompose nor MultiConnector can cut it short, and
sending the next calls past the stuck child cannot help either, as there is no
other thread to make them. What kvcompose can do is make the stall visible at
once, on the thread that is not stuck.

A daemon thread per process looks at the stacks of the process's threads
every :data:`POLL_S` (``sys._current_frames``, so the calls themselves pay
nothing). Where a stack runs a composite's method (registered with
:meth:`Watchdog.watch`), the call into the child it is making is found among
that method's locals. The same call found at consecutive looks has run since
the first: past the pipeline's ``watchdog_s`` it is logged at WARNING with the
child's stack and reported stuck (:class:`StuckCalls`), and logged again when
it returns. The watchdog records no latency: kvcompose times every call it
observes itself.
"""

from __future__ import annotations

import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from time import monotonic
from types import FrameType, FunctionType
from typing import TYPE_CHECKING, Any

from kvcompose.instrumentation.base import RunningCalls
from kvcompose.log_throttle import LogThrottle
from kvcompose.logs import get_logger

if TYPE_CHECKING:
    from kvcompose.connectors.calls import ChildCalls
    from kvcompose.connectors.children import Child
    from kvcompose.operations import Operation

logger = get_logger("watchdog")

POLL_S = 0.25
STACK_FRAMES = 20  # of the child's stack, logged with a stuck call (the innermost ones)
THREAD_NAME = "kvcompose-watchdog"


@dataclass
class _Watched:
    """A composite the watchdog looks at."""

    composite: weakref.ref[Any]
    pipeline: str
    role: str
    calls: ChildCalls
    watchdog_s: float
    on_running: Callable[[RunningCalls], None] | None


@dataclass
class _Running:
    """A call into a child seen running at consecutive looks."""

    frame: FrameType  # the composite method's frame: a new call makes a new one
    call: Any
    watched: _Watched
    operation: Operation
    child: Child
    first_seen: float
    last_seen: float
    warned: bool = False

    @property
    def seconds(self) -> float:
        """How long it has run: it started within a look before it was first seen."""
        return self.last_seen - self.first_seen + POLL_S / 2

    @property
    def long(self) -> bool:
        """Seen at two looks or more: it has run at least a look's interval."""
        return self.last_seen > self.first_seen


class Watchdog:
    """This process's watchdog; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, _Watched] = {}  # id(composite) -> what to look at
        self._codes: frozenset[Any] = frozenset()  # the code objects of every watched composite's methods
        self._running: dict[int, _Running] = {}  # thread id -> its call seen running
        self._thread: threading.Thread | None = None

    def watch(
        self, composite: Any, pipeline: str, role: str, calls: ChildCalls, watchdog_s: float, on_running: Callable[[RunningCalls], None] | None = None,
    ) -> None:
        """Look at ``composite``'s calls into its children from now on (``on_running``: told the composite's calls
        seen running at consecutive looks, at every look while it has some, and once more when they are gone)."""
        module = type(composite).__module__
        codes = {function.__code__ for cls in type(composite).__mro__ if cls.__module__ == module
                 for function in vars(cls).values() if isinstance(function, FunctionType)}
        with self._lock:
            self._watched[id(composite)] = _Watched(weakref.ref(composite), pipeline, role, calls, watchdog_s,
                                                    on_running)
            self._codes = self._codes | codes
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()

    def unwatch(self, composite: Any) -> None:
        with self._lock:
            self._watched.pop(id(composite), None)

    def _run(self) -> None:
        tick, failures = threading.Event(), LogThrottle(lines=1, interval_s=3600)
        while not tick.wait(POLL_S):
            try:
                self.look()
            except Exception as error:  # the watchdog must never take the engine down, nor flood its log
                if failures.admit(type(error).__name__):
                    logger.exception("watchdog look failed; it goes on looking")

    def look(self, now: float | None = None) -> None:
        """One look at every other thread's stack."""
        now = monotonic() if now is None else now
        with self._lock:
            watched, codes = dict(self._watched), self._codes
        seen: dict[int, _Running] = {}
        for thread_id, frame in sys._current_frames().items():
            if thread_id == threading.get_ident() or (found := self._find_call(frame, watched, codes)) is None:
                continue
            running = self._running.get(thread_id)
            if running is not None and running.frame is found[0] and running.call is found[1]:
                running.last_seen = now
            else:
                running = _Running(*found, first_seen=now, last_seen=now)
            seen[thread_id] = running
            if not running.warned and running.seconds >= running.watched.watchdog_s:
                self._warn(running, frame)
        for thread_id, running in self._running.items():
            if seen.get(thread_id) is not running:
                self._returned(running)
        reporting = {id(r.watched): r.watched for r in (*self._running.values(), *seen.values()) if r.long}
        self._running = seen
        for entry in reporting.values():
            if entry.on_running is not None:
                entry.on_running({(r.child.name, r.operation.label or r.operation.name): (r.seconds, r.warned)
                                  for r in seen.values() if r.watched is entry and r.long})

    def _find_call(
        self, frame: FrameType, watched: dict[int, _Watched], codes: frozenset[Any],
    ) -> tuple[FrameType, Any, _Watched, Operation, Child] | None:
        """(the composite's frame, the call it makes, its composite, operation, child) of the innermost composite
        method on this stack making a call into a child."""
        current: FrameType | None = frame
        while current is not None:
            if current.f_code in codes:
                composite = current.f_locals.get("self")
                entry = watched.get(id(composite))
                if entry is None or entry.composite() is not composite:
                    return None
                for value in current.f_locals.values():
                    if (owner := entry.calls.find(value)) is not None:
                        return current, value, entry, owner[0], owner[1]
                return None  # a composite method between its calls into children
            current = current.f_back
        return None

    def _warn(self, running: _Running, frame: FrameType) -> None:
        running.warned = True
        logger.warning(
            "child call is running long", pipeline=running.watched.pipeline, role=running.watched.role,
            connector=running.child.name, op=running.operation.label or running.operation.name,
            running_s=round(running.seconds, 2), watchdog_s=running.watched.watchdog_s,
            child_stack=_child_stack(frame, running.frame),
        )

    def _returned(self, running: _Running) -> None:
        """A call seen at a look before has returned."""
        if running.warned:
            logger.warning("child call returned after running long", pipeline=running.watched.pipeline,
                           role=running.watched.role, connector=running.child.name,
                           op=running.operation.label or running.operation.name, ran_s=round(running.seconds, 2))


def _child_stack(frame: FrameType, composite_frame: FrameType) -> list[str]:
    """The stack inside the child's call (innermost last), as ``file:line in function`` lines."""
    frames = []
    current: FrameType | None = frame
    while current is not None and current is not composite_frame:
        frames.append(current)
        current = current.f_back
    summary = traceback.StackSummary.extract((f, f.f_lineno) for f in reversed(frames[:STACK_FRAMES]))
    return [f"{entry.filename}:{entry.lineno} in {entry.name}" for entry in summary]


_WATCHDOG: Watchdog | None = None
_WATCHDOG_LOCK = threading.Lock()


def watchdog() -> Watchdog:
    """This process's watchdog (its thread starts with the first composite it watches)."""
    global _WATCHDOG
    with _WATCHDOG_LOCK:
        if _WATCHDOG is None:
            _WATCHDOG = Watchdog()
        return _WATCHDOG
