"""Log lines that outside input can trigger, kept cheap and bounded.

A problem read from a request (or any other input a client controls) may
repeat on every request, with endless variations. :class:`LogThrottle`
logs each distinct problem once while it is remembered (a fixed number of
16-byte digests, the oldest forgotten first) and at most ``lines`` lines per
``interval_s``; the next line that gets through counts what was held back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from time import monotonic


def digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "backslashreplace"), digest_size=16).digest()


class LogThrottle:
    """Decides which problems are logged: new ones, within a rate."""

    def __init__(
        self, remembered: int = 1024, lines: int = 10, interval_s: float = 60.0,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._remembered = remembered
        self._lines = lines
        self._interval_s = interval_s
        self._clock = clock
        self._window_start = -float("inf")
        self._logged_in_window = 0
        self.suppressed = 0  # problems held back by the rate since the last line that got through

    def admit(self, problem: str) -> bool:
        """True if ``problem`` should be logged now; the caller then reports and resets :attr:`suppressed`."""
        key = digest(problem)
        if key in self._seen:
            self._seen.move_to_end(key)
            return False
        now = self._clock()
        if now - self._window_start >= self._interval_s:
            self._window_start, self._logged_in_window = now, 0
        if self._logged_in_window >= self._lines:
            self.suppressed += 1  # not remembered: it may be logged once the rate allows
            return False
        self._logged_in_window += 1
        self._seen[key] = None
        if len(self._seen) > self._remembered:
            self._seen.popitem(last=False)
        return True

    def take_suppressed(self) -> int:
        count, self.suppressed = self.suppressed, 0
        return count

    @property
    def remembered(self) -> int:
        """How many problems are remembered as logged (at most ``remembered``)."""
        return len(self._seen)
