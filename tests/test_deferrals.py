"""How long a child may answer a request's lookup "ask again later", and how its breaker counts that."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcompose.config import ChildConfig
from kvcompose.connectors.deferrals import Deferrals, LookupDeferredTooLong
from kvcompose.connectors.isolation import BreakerState, ChildGuard
from kvcompose.operations import OPERATIONS

LOOKUP = OPERATIONS["get_num_new_matched_tokens"]


def test_a_deferral_expires_per_request_and_child() -> None:
    deferrals = Deferrals(limit_s=0.0)  # every deferral after the first of a (request, child) is past the limit
    assert not deferrals.expired("a", 0)  # the first: the clock starts
    assert not deferrals.expired("b", 0)  # another request has a clock of its own
    assert not deferrals.expired("a", 1)  # another child deferring the same request starts it again
    assert deferrals.expired("a", 1)
    assert not deferrals.expired("a", 1)  # an expired deferral starts afresh
    deferrals.settled("a")
    deferrals.settled("b")
    assert not deferrals and deferrals.sizes() == {}
    never = Deferrals(limit_s=None)  # watchdog_s: null, MultiConnector's behaviour
    assert not any(never.expired("a", 0) for _ in range(3)) and not never


def test_a_deferral_does_not_settle_a_lookups_failures() -> None:
    """The breaker forgets a lookup's failures on an answer with tokens, not on "ask again later"."""
    answers = iter([(None, False), (None, False), (0, False)])

    def lookup() -> tuple[int | None, bool]:
        return next(answers)

    bound: dict[str, Callable[[], Any]] = {}

    def bind(guard: ChildGuard, state_changed: bool) -> None:  # what the composite does on a change
        bound["lookup"] = guard.gate(LOOKUP, lookup)

    guard = ChildGuard(ChildConfig(name="offload", connector="OffloadingConnector",
                                   circuit_breaker={"failures": 3, "cooldown_s": 60}), on_change=bind)
    bind(guard, False)
    guard.answer(LOOKUP, LookupDeferredTooLong(5.0))
    assert guard.consecutive_failures == {LOOKUP.name: 1}
    bound["lookup"]()
    bound["lookup"]()
    assert guard.consecutive_failures == {LOOKUP.name: 1}  # deferred twice: still owed
    assert bound["lookup"]() == (0, False)
    assert guard.consecutive_failures == {} and guard.state is BreakerState.CLOSED  # settled: forgotten
