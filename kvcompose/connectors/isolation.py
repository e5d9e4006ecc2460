"""Failure isolation per child: ``on_error`` and a circuit breaker.

A child call that raises under ``on_error: isolate`` is logged, counted,
marked on the current span and answered with a neutral result, so the
composite carries on without that child. Where the composite has to repair
something after a failed call (a load that will not happen, a save that will
never be reported), the answer is :data:`FAILED`; the composite checks for it.
A result that is iterated after the call returns (``take_events`` may return
a generator) is isolated while it is iterated: the events yielded before the
failure are kept, and the failure is the call's.

The circuit breaker watches the data path only: the calls in
:data:`DATA_PATH_OPERATIONS`, which find, load and save KV, the per-layer ones
included (the composite's per-layer loops report their outcomes). It counts
consecutive failures per operation: ``circuit_breaker.failures`` failed calls
of one operation in a row open the circuit, and a successful call of that
operation starts its count again. Per operation, because a tier that can no
longer save may still answer lookups, and one operation's successes must not
hide another's failures. Housekeeping calls (metadata, events, pending frees,
...) run every step whatever the traffic: their successes say nothing about
the tier, so they never reset a count, and their failures, isolated and
counted like any other, never open the circuit.

While the circuit is open, no call reaches the child; each gets the same
answer as a failed call. Once ``cooldown_s`` has passed the circuit is half
open: housekeeping calls go through again (a worker must bind the step's
metadata before it can load), and exactly one data-path call is let through
as the probe (per-layer calls stay out of the loops until the circuit
closes). Any other data-path call made while the probe runs gets the failed
answer. The probe's success closes the circuit and clears every count; its
failure opens it for another ``cooldown_s``.

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
from kvcompose.tracing.pipeline import qualified_name

logger = get_logger("isolation")

CIRCUIT_OPEN = "kvcompose.circuit_open"  # error.type of a call skipped while the circuit is open


class _Failed:
    """The answer of a failed or skipped call the composite must repair."""

    def __repr__(self) -> str:
        return "FAILED"


FAILED: Any = _Failed()


def _nothing() -> None:
    return None


# What an isolated call answers, per operation. The per-layer calls
# (save_kv_layer, wait_for_layer_load) are isolated by the composite's own
# loops instead: a wrapper per layer and child would cost more than the call.
# Operations not listed always raise.
FALLBACKS: dict[str, Callable[[], Any]] = {
    # scheduler side
    "get_num_new_matched_tokens": lambda: (0, False),
    "get_external_cache_hit_sources": dict,
    "update_state_after_alloc": lambda: FAILED,
    "on_new_request": _nothing,
    "build_connector_meta": lambda: FAILED,
    "update_connector_output": _nothing,
    "request_finished": lambda: (False, None),
    "request_finished_all_groups": lambda: (False, None),
    "take_events": tuple,
    "has_pending_block_frees": lambda: False,
    "has_pending_push_work": lambda: False,
    "reset_cache": lambda: False,
    "get_kv_connector_stats": _nothing,
    # worker side
    "bind_connector_metadata": lambda: FAILED,
    "clear_connector_metadata": _nothing,
    "handle_preemptions": _nothing,
    "start_load_kv": lambda: FAILED,
    "wait_for_save": _nothing,
    "finish_forward": _nothing,
    "get_transfer_results": lambda: FAILED,
    "get_block_ids_with_load_errors": lambda: FAILED,
    "build_connector_worker_meta": _nothing,
}

# The calls whose outcomes drive the circuit breaker (see the module docstring).
DATA_PATH_OPERATIONS = frozenset({
    "get_num_new_matched_tokens", "update_state_after_alloc", "request_finished", "request_finished_all_groups",
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_transfer_results",
    "get_block_ids_with_load_errors",
})

# Operations whose result may be iterated after the call returns.
ITERATED_OPERATIONS = frozenset({"take_events"})


class BreakerState(enum.IntEnum):
    """Values of the ``kvcompose_child_state`` gauge."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


FailureHook = Callable[[str, str, Exception], None]  # (child name, operation, error)


class ChildGuard:
    """Isolation and the circuit breaker of one child, in one process.

    ``on_state_change`` is told when the circuit changes state, ``on_failure``
    of every isolated failure (for the metrics).
    """

    def __init__(
        self, config: ChildConfig, on_state_change: Callable[[ChildGuard], None] | None = None,
        on_failure: FailureHook | None = None,
    ) -> None:
        self.name = config.name
        self.isolate = config.on_error == "isolate"
        self._breaker_enabled = config.circuit_breaker.enabled
        self._threshold = config.circuit_breaker.failures
        self._cooldown_s = config.circuit_breaker.cooldown_s
        self._on_state_change = on_state_change
        self._on_failure = on_failure
        self.state = BreakerState.CLOSED
        # Data-path operation -> its consecutive failures; only operations with at least one.
        self.consecutive_failures: dict[str, int] = {}
        self._opens_unreported = 0
        self._reported_state = BreakerState.CLOSED
        self._open_until = 0.0
        self._probe = threading.Lock()  # held by the one probing call of a half-open circuit
        # Calls answered with a fallback (failed or skipped), and why the last one was: the tracer
        # compares the count around a call to mark its span.
        self.failures = 0
        self.last_error_type = ""
        # Worker side: an open circuit turns half open only when a step starts (step_started), so the
        # child is given that step's metadata before its probe; mid-step, its probe would find none.
        self.half_open_at_step_start = False
        self._reporting_layer_calls: dict[str, Callable[..., Any]] = {}  # see layer_call

    # ---- wrapping child calls (once, at start-up) ----

    def wrap(self, operation: str, call: Callable[..., Any]) -> Callable[..., Any]:
        fallback = FALLBACKS.get(operation)
        if fallback is None or not self.isolate:
            return call
        if operation in DATA_PATH_OPERATIONS:
            return self._wrap_data_call(operation, call, fallback)
        return self._wrap_housekeeping_call(operation, call, fallback)

    def _wrap_data_call(
        self, operation: str, call: Callable[..., Any], fallback: Callable[[], Any]
    ) -> Callable[..., Any]:
        # Runs on every call: an enum member read from its class costs ~150 ns on
        # Python 3.11, so it is read once here, and a success in a closed circuit
        # with no failures to forget makes no further call.
        closed = BreakerState.CLOSED

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.state is not closed:
                return self._call_while_not_closed(operation, call, fallback, args, kwargs)
            try:
                result = call(*args, **kwargs)
            except Exception as error:
                self.failed(operation, error)
                return fallback()
            if self.consecutive_failures:
                self.succeeded(operation)
            return result

        return guarded

    def _wrap_housekeeping_call(
        self, operation: str, call: Callable[..., Any], fallback: Callable[[], Any]
    ) -> Callable[..., Any]:
        closed = BreakerState.CLOSED
        iterated = operation in ITERATED_OPERATIONS

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.state is not closed and not self._cooled_down():
                return self._skipped(fallback)
            try:
                result = call(*args, **kwargs)
            except Exception as error:
                self.failed(operation, error)
                return fallback()
            return self._isolate_iteration(operation, result) if iterated else result

        return guarded

    def _call_while_not_closed(
        self, operation: str, call: Callable[..., Any], fallback: Callable[[], Any], args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """A data-path call of an open or half-open circuit: skipped, or made as the one probe."""
        if not self._cooled_down() or not self._probe.acquire(blocking=False):
            return self._skipped(fallback)
        try:
            if self.state is not BreakerState.HALF_OPEN:  # another probe settled it meanwhile
                return self._skipped(fallback)
            try:
                result = call(*args, **kwargs)
            except Exception as error:
                self.failed(operation, error)  # opens the circuit again
                return fallback()
            self.consecutive_failures.clear()
            self._set_state(BreakerState.CLOSED)
            return result
        finally:
            self._probe.release()

    def _isolate_iteration(self, operation: str, result: Any) -> Any:
        """A result iterated later (a generator) fails while it is iterated: isolate that too."""
        if not isinstance(result, Iterator):
            return result

        def isolated() -> Iterator[Any]:
            try:
                yield from result
            except Exception as error:
                self.failed(operation, error)

        return isolated()

    def layer_call(self, operation: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """The per-layer ``call`` (always the same one per operation) the composite's loop
        should make: ``call`` itself, or, while the operation has failures to forget, one
        that reports its success (the same object each time it is asked for)."""
        if operation not in self.consecutive_failures:
            return call
        if (reporting := self._reporting_layer_calls.get(operation)) is None:

            def reporting(*args: Any, **kwargs: Any) -> Any:
                result = call(*args, **kwargs)
                if self.consecutive_failures:
                    self.succeeded(operation)
                return result

            self._reporting_layer_calls[operation] = reporting
        return reporting

    # ---- outcomes ----

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

    def _skipped(self, fallback: Callable[[], Any]) -> Any:
        self.failures += 1
        self.last_error_type = CIRCUIT_OPEN
        return fallback()

    def succeeded(self, operation: str) -> None:
        """A data-path call succeeded: its operation's failures are forgotten."""
        self.consecutive_failures.pop(operation, None)

    def failed(self, operation: str, error: Exception) -> None:
        """Record an isolated failure: log it (inside its span's ids), tell the tracer, report it;
        a data-path failure counts toward opening the circuit."""
        counts = operation in DATA_PATH_OPERATIONS
        if counts:
            self.consecutive_failures[operation] = self.consecutive_failures.get(operation, 0) + 1
        self.failures += 1
        self.last_error_type = qualified_name(type(error))
        logger.warning(
            "child call failed", connector=self.name, op=operation, error_type=type(error).__name__,
            consecutive_failures=self.consecutive_failures.get(operation, 0), isolated=self.isolate,
        )
        if self._on_failure is not None:
            self._on_failure(self.name, operation, error)
        if counts and self._breaker_enabled and (
            self.state is BreakerState.HALF_OPEN or self.consecutive_failures[operation] >= self._threshold
        ):
            self._open()

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
        if self._on_state_change is not None:
            self._on_state_change(self)
