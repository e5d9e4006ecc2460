"""Failure isolation per child: ``on_error`` and a circuit breaker.

A child call that raises under ``on_error: isolate`` is logged, marked on the
current span and answered with a neutral result, so the composite carries on
without that child. While a child's circuit is open its calls are not made at
all and get the same answer. Where the composite has to repair something
after a failed call (a load that will not happen, a save that will never be
reported), the answer is :data:`FAILED`; the composite checks for it.

Calls made once at start-up (registering caches, memory pools, handshakes)
are never isolated: a child that cannot start should stop the engine with its
name in the message.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
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


class BreakerState(enum.IntEnum):
    """Values of the ``kvcompose_child_state`` gauge."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class ChildGuard:
    """Isolation and the circuit breaker of one child, in one process."""

    def __init__(self, config: ChildConfig, on_state_change: Callable[[ChildGuard], None] | None = None) -> None:
        self.name = config.name
        self.isolate = config.on_error == "isolate"
        self._breaker_enabled = config.circuit_breaker.enabled
        self._threshold = config.circuit_breaker.failures
        self._cooldown_s = config.circuit_breaker.cooldown_s
        self._on_state_change = on_state_change
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self._opens_unreported = 0
        self._reported_state = BreakerState.CLOSED
        self._open_until = 0.0
        # Calls answered with a fallback (failed or skipped), and why the last one was: the tracer
        # compares the count around a call to mark its span.
        self.failures = 0
        self.last_error_type = ""

    # ---- wrapping child calls (once, at start-up) ----

    def wrap(self, operation: str, call: Callable[..., Any]) -> Callable[..., Any]:
        fallback = FALLBACKS.get(operation)
        if fallback is None or not self.isolate:
            return call

        # Runs on every call: an enum member read from its class costs ~150 ns on
        # Python 3.11, so it is read once here, and a success in a closed circuit
        # with no failures to forget makes no further call.
        closed = BreakerState.CLOSED

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.state is not closed and not self.allows_call():
                self.failures += 1
                self.last_error_type = CIRCUIT_OPEN
                return fallback()
            try:
                result = call(*args, **kwargs)
            except Exception as error:
                self.failed(operation, error)
                return fallback()
            if self.consecutive_failures or self.state is not closed:
                self.succeeded()
            return result

        return guarded

    # ---- outcomes ----

    def allows_call(self) -> bool:
        """False while the circuit is open; after the cool-down, one probing call at a time."""
        if self.state is BreakerState.OPEN and monotonic() >= self._open_until:
            self._set_state(BreakerState.HALF_OPEN)
            return True
        return self.state is not BreakerState.OPEN

    def succeeded(self) -> None:
        self.consecutive_failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self._set_state(BreakerState.CLOSED)

    def failed(self, operation: str, error: Exception) -> None:
        """Record a failed call, log it (inside its span's ids), maybe open the circuit."""
        self.consecutive_failures += 1
        self.failures += 1
        self.last_error_type = qualified_name(type(error))
        logger.warning(
            "child call failed", connector=self.name, op=operation, error_type=type(error).__name__,
            consecutive_failures=self.consecutive_failures, isolated=self.isolate,
        )
        if self._breaker_enabled and (
            self.state is BreakerState.HALF_OPEN or self.consecutive_failures >= self._threshold
        ) and self.state is not BreakerState.OPEN:
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
