"""Which calls are timed: one in ``metrics.sample_every``, and the next one after the engine was idle.

Reading the clock twice costs more than a call into a child that has nothing
to do, so kvcompose times a sample of the calls. A timed call stands for the
calls counted since the previous timed one, itself included (its *weight*):
its latency goes to its histogram bucket that many times, so the buckets add
up to the calls made and ``_sum`` is an estimate. When the engine goes idle,
the calls counted since an operation's last timed call are credited to that
call's latency (:meth:`CallSampler.take_uncredited`), and the operation's next
call is timed, so a lightly loaded engine still shows every operation.

What is counted is up to the caller: a composite call on the scheduler side,
a whole step on the worker side (every step makes the same calls). A step
timed for a reason of its own (it moves KV, or it is traced) is not counted
here: it stands for itself.
"""

from __future__ import annotations


class CallSampler:
    """The countdown of one operation (or of the worker's steps)."""

    __slots__ = ("every", "_left", "_uncredited")

    def __init__(self, every: int) -> None:
        self.every = every
        self._left = 1  # the first call is timed
        self._uncredited = 0  # calls counted since the last timed one

    def count(self) -> int:
        """Count one call: 0 if it is not timed; else it is, and stands for this many calls."""
        self._uncredited += 1
        self._left -= 1
        if self._left:
            return 0
        weight, self._uncredited, self._left = self._uncredited, 0, self.every
        return weight

    def take_uncredited(self) -> int:
        """The engine goes idle: the calls counted since the last timed one, now credited to it. The next call
        is timed."""
        calls, self._uncredited, self._left = self._uncredited, 0, 1
        return calls

    def uncount(self) -> None:
        """A call counted here was timed on its own after all (the watchdog saw it run long)."""
        if self._uncredited:
            self._uncredited -= 1
