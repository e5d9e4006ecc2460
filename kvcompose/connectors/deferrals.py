"""Lookups that ask again later, and how long kvcompose lets a child ask.

A child answers a lookup with ``None`` tokens when it needs more time; vLLM
keeps the request waiting and asks again at its next step. A child can keep
answering so for good: vLLM's OffloadingConnector defers a lookup while the
blocks it finds are still being stored, and learns that a store ended only
from its worker side; if that side failed and was isolated, the request
would wait forever. MultiConnector would wait with it.

kvcompose lets one child defer one request's lookup for at most the
pipeline's ``watchdog_s``. Past that, the child's answer counts as a failed
lookup (:class:`LookupDeferredTooLong`): a miss for that child, or the error
raised where the child does not isolate its errors. The child's circuit
breaker counts it like any failure, and a deferral does not settle earlier
failures (``Operation.settles``), so a child that keeps deferring has its
circuit opened and is skipped until its cool-down has passed.
"""

from __future__ import annotations

from time import monotonic


class LookupDeferredTooLong(TimeoutError):
    """A child kept answering a request's lookup with "ask again later" past the pipeline's ``watchdog_s``."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(f"the lookup was still deferred ('ask again later') after {limit_s:g} s (watchdog_s)")


class Deferrals:
    """The scheduler's deferred lookups: request id -> (the deferring child's index, since when)."""

    def __init__(self, limit_s: float | None) -> None:
        self.limit_s = limit_s  # None: a child may defer for ever (MultiConnector's behaviour)
        self._since: dict[str, tuple[int, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._since)

    def expired(self, req_id: str, child: int) -> bool:
        """``child`` deferred the request's lookup (again): whether it has now deferred it past the limit."""
        if self.limit_s is None:
            return False
        now = monotonic()
        deferred = self._since.get(req_id)
        if deferred is None or deferred[0] != child:
            self._since[req_id] = (child, now)
            return False
        if now - deferred[1] < self.limit_s:
            return False
        del self._since[req_id]
        return True

    def settled(self, req_id: str) -> None:
        """The request's lookup was answered, or the request finished."""
        self._since.pop(req_id, None)

    def sizes(self) -> dict[str, int]:
        return {"deferred_lookups": len(self._since)} if self._since else {}
