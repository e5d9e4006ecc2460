"""Failure isolation per child: ``on_error`` and a circuit breaker.

A child call that raises under ``on_error: isolate`` is logged, counted and
answered with its operation's fallback (``Operation.fallback`` in
:mod:`kvcompose.operations`), so the composite carries on without that child.
Where the composite has to repair something after a failed call (a load that
will not happen, a save that will never be reported), the answer is
:data:`~kvcompose.operations.FAILED`. A result that is iterated after the call
returns (``take_events`` may return a generator) is isolated while it is
iterated: the events yielded before the failure are kept.

Where the failure is caught: the composite's own loops catch a failure and
ask :meth:`ChildGuard.answer` for the answer, as vLLM's MultiConnector loops
call its children directly. Only a result iterated after the call
(``take_events``) is isolated by a wrapper (:meth:`ChildGuard.isolating`).
The data-path calls (``Operation.data_path``: those that find, load and save
KV, made per request, step or layer) are the ones the circuit breaker watches.

The circuit breaker watches the data path only. It counts consecutive
failures per operation: ``circuit_breaker.failures`` failed calls of one
operation in a row open the circuit, and a successful call of that operation
starts its count again. Per operation, because a tier that can no longer save
may still answer lookups, and one operation's successes must not hide
another's failures. Housekeeping calls (metadata, events, pending frees, ...)
run every step whatever the traffic: their successes say nothing about the
tier, so they never reset a count, and their failures, isolated and counted
like any other, never open the circuit.

While the circuit is open, no call reaches the child: it raises
:class:`CircuitOpen` instead (the span shows ``error.type`` =
``kvcompose.circuit_open``) and gets the same answer as a failed call. Once
``cooldown_s`` has passed the circuit is half open: housekeeping calls go
through again (a worker must bind the step's metadata before it can load),
and exactly one data-path call is let through as the probe (per-layer calls
stay out of the loops until the circuit closes). Any other data-path call
made while the probe runs is skipped. The probe's success closes the circuit
and clears every count; its failure opens it for another ``cooldown_s``.

The breaker's state decides how each child call is made (:meth:`ChildGuard.gate`):
a closed circuit with no failures to forget adds nothing; otherwise a gate
skips, probes or reports successes. The composite makes the child's calls again
whenever that changes (``on_change``).

Calls made once at start-up (registering caches, memory pools, handshakes)
are never isolated: a child that cannot start should stop the engine with its
name in the message.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterator
from time import monotonic
from typing import Any

from kvcompose.config import ChildConfig
from kvcompose.logs import get_logger
from kvcompose.operations import CIRCUIT_OPEN, CircuitOpen, Operation
from kvcompose.names import qualified_name

logger = get_logger("isolation")

class BreakerState(enum.IntEnum):
    """Values of the ``kvcompose_child_state`` gauge."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


FailureHook = Callable[[str, Operation, Exception], None]  # (child name, operation, error)
# Told when the child's calls must be made again: (guard, whether the circuit changed state).
ChangeHook = Callable[["ChildGuard", bool], None]


class ChildGuard:
    """Isolation and the circuit breaker of one child, in one process.

    ``on_change`` is told when the child's calls must be made again (the
    circuit changed state, or an operation has failures to forget or no
    longer has), ``on_failure`` of every failure a call raised (for the metrics).
    """

    def __init__(
        self, config: ChildConfig, on_change: ChangeHook | None = None, on_failure: FailureHook | None = None,
    ) -> None:
        self.name = config.name
        self.isolate = config.on_error == "isolate"
        self._breaker_enabled = config.circuit_breaker.enabled
        self._threshold = config.circuit_breaker.failures
        self._cooldown_s = config.circuit_breaker.cooldown_s
        self._on_change = on_change
        self._on_failure = on_failure
        self.state = BreakerState.CLOSED
        # Data-path operation -> its consecutive failures; only operations with at least one.
        self.consecutive_failures: dict[str, int] = {}
        self._opens_unreported = 0
        self._reported_state = BreakerState.CLOSED
        self._open_until = 0.0
        self._probe = threading.Lock()  # held by the one probing call of a half-open circuit
        # Calls answered with a fallback (failed or skipped), and why the last one was: the transfer
        # tracker tells a transfer failed by its child's call from one the child reported.
        self.failures = 0
        self.last_error_type = ""
        # Worker side: an open circuit turns half open only when a step starts (step_started), so the
        # child is given that step's metadata before its probe; mid-step, its probe would find none.
        self.half_open_at_step_start = False

    @property
    def closed(self) -> bool:
        return self.state is BreakerState.CLOSED

    # ---- how a call is made (made again on every change) ----

    def gate(self, operation: Operation, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` as the breaker's state has it made now: as is, skipped or probed, or reporting
        its success while its operation has failures to forget. Calls never isolated (start-up,
        shutdown) are never gated either."""
        if not self.isolate or operation.fallback is None:
            return call
        if self.state is BreakerState.CLOSED:
            if operation.name in self.consecutive_failures:
                return self._reporting(operation, call)
            return call
        if operation.data_path:
            return self._probing(call)
        return self._skipped_until_cooled_down(call)

    def _reporting(self, operation: Operation, call: Callable[..., Any]) -> Callable[..., Any]:
        settles = operation.settles

        def reporting(*args: Any, **kwargs: Any) -> Any:
            result = call(*args, **kwargs)
            if settles is None or settles(result):
                self.succeeded(operation.name)
            return result

        return reporting

    def _probing(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """A data-path call of an open or half-open circuit: skipped, or made as the one probe."""

        def probing(*args: Any, **kwargs: Any) -> Any:
            if not self._cooled_down() or not self._probe.acquire(blocking=False):
                raise CircuitOpen
            try:
                if self.state is not BreakerState.HALF_OPEN:  # another probe settled it meanwhile
                    raise CircuitOpen
                result = call(*args, **kwargs)  # a failure reaches answer(), which opens the circuit again
            finally:
                self._probe.release()
            self.consecutive_failures.clear()
            self._set_state(BreakerState.CLOSED)
            return result

        return probing

    def _skipped_until_cooled_down(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def housekeeping(*args: Any, **kwargs: Any) -> Any:
            if not self._cooled_down():
                raise CircuitOpen
            return call(*args, **kwargs)

        return housekeeping

    def isolating(self, operation: Operation, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` answering its failures, for an isolated operation whose result is iterated after the call
        (the composite's loops catch every other failure themselves)."""
        if not self.isolate or operation.fallback is None or not operation.iterated:
            return call

        def isolated(*args: Any, **kwargs: Any) -> Any:
            try:
                result = call(*args, **kwargs)
            except Exception as error:
                return self.answer(operation, error)
            return self._isolate_iteration(operation, result)

        return isolated

    def _isolate_iteration(self, operation: Operation, result: Any) -> Any:
        """A result iterated later (a generator) fails while it is iterated: isolate that too."""
        if not isinstance(result, Iterator):
            return result

        def isolated() -> Iterator[Any]:
            try:
                yield from result
            except Exception as error:
                self._failed(operation, error)

        return isolated()

    # ---- outcomes ----

    def answer(self, operation: Operation, error: Exception) -> Any:
        """What a failed (or skipped) call of ``operation`` answers: its fallback, once the failure is
        recorded. Re-raises ``error``, recorded, if this child does not isolate its errors."""
        if isinstance(error, CircuitOpen):
            self.failures += 1
            self.last_error_type = CIRCUIT_OPEN
            return operation.fallback()  # type: ignore[misc]
        self._failed(operation, error)
        if not self.isolate or operation.fallback is None:
            raise error
        return operation.fallback()

    def _cooled_down(self) -> bool:
        """True once an open circuit's cool-down has passed; it is then half open."""
        if self.state is BreakerState.OPEN:
            if self.half_open_at_step_start or monotonic() < self._open_until:
                return False
            self._set_state(BreakerState.HALF_OPEN)
        return True

    def step_started(self) -> None:
        """Worker side, before the step's metadata is bound: an open circuit whose cool-down has passed
        turns half open now."""
        if self.state is BreakerState.OPEN and monotonic() >= self._open_until:
            self._set_state(BreakerState.HALF_OPEN)

    def succeeded(self, operation: str) -> None:
        """A data-path call succeeded: its operation's failures are forgotten."""
        if self.consecutive_failures.pop(operation, None) is not None and self._on_change is not None:
            self._on_change(self, False)

    def _failed(self, operation: Operation, error: Exception) -> None:
        """Record a failure: log it, report it; an isolated data-path failure counts toward opening
        the circuit."""
        name = operation.name
        counts = self._breaker_enabled and operation.data_path and self.isolate and operation.fallback is not None
        first = False
        if counts:
            failures = self.consecutive_failures.get(name, 0) + 1
            self.consecutive_failures[name], first = failures, failures == 1
        self.failures += 1
        self.last_error_type = qualified_name(type(error))
        logger.warning(
            "child call failed", connector=self.name, op=name, error_type=type(error).__name__,
            consecutive_failures=self.consecutive_failures.get(name, 0), isolated=self.isolate,
        )
        if self._on_failure is not None:
            self._on_failure(self.name, operation, error)
        if counts and (self.state is BreakerState.HALF_OPEN or self.consecutive_failures[name] >= self._threshold):
            self._open()
        elif first and self._on_change is not None:
            self._on_change(self, False)  # its successes report now

    def _open(self) -> None:
        if self.state is BreakerState.OPEN:
            return
        self._open_until = monotonic() + self._cooldown_s
        self._opens_unreported += 1
        self._set_state(BreakerState.OPEN)

    def take_report(self) -> dict[str, int] | None:
        """The breaker's state and opens since the last report; None when closed and unchanged."""
        if self.state is BreakerState.CLOSED and self._reported_state is BreakerState.CLOSED and not (
            self._opens_unreported
        ):
            return None
        report = {"state": int(self.state), "opens": self._opens_unreported}
        self._reported_state, self._opens_unreported = self.state, 0
        return report

    def _set_state(self, state: BreakerState) -> None:
        self.state = state
        logger.warning("circuit breaker", connector=self.name, state=state.name.lower(),
                       cooldown_s=self._cooldown_s)
        if self._on_change is not None:
            self._on_change(self, True)
