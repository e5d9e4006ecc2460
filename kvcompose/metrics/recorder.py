"""Per-process recording of the composite's calls into its children: latency, counts and what the calls meant.

Latency is measured on a sample of each operation's calls. Two clock reads
cost more than a call into a child that has nothing to do (about 40 ns each
against 20-35 ns on these CPUs), so timing every call would cost several times
MultiConnector's forwarding; a sample of one call in ``metrics.sample_every``
(default 32) costs a countdown per call. The sample is taken per composite
operation (:class:`OperationSampler`): a sampled call of the composite times
every child it calls, through their timed calls (:meth:`PipelineRecorder.timed`).

Every call is still counted. A timed call stands for itself and for the
untimed calls of its operation since the previous timed one: its bucket gets
that many calls (its *weight*), and the summed seconds that many times its
latency. So the latency histogram's buckets and count add up to the calls
kvcompose made, and ``_sum`` is an estimate. The calls made since an
operation's last timed call are credited to that call's bucket when the engine
goes idle (:meth:`PipelineRecorder.flush`); after that, the next call of an
operation not timed in the last second is timed, so a lightly loaded engine
still shows every operation's latency. While the engine is busy, an
operation's count trails by fewer than ``sample_every`` calls. With
``sample_every: 1`` every call is timed and counted at once.

What the calls meant is counted where vLLM counts it, told by the
instrumentation:

- lookups (hit or miss, tokens matched) once per admitted request, when vLLM
  first allocates its blocks, from the loaders' answers in the request's last
  lookup round (vLLM asks again every step while a request waits for blocks, and
  counts its own external-cache hits at admission too). vLLM allocates again for
  a request it admitted before (once an async load completes, when a preempted
  request resumes): the instrumentation tells only the first. A loader whose
  lookup failed is counted neither way;
- tokens loaded, at that first admission, for the child chosen to load (if it accepted);
- blocks that failed to load, as block ids per scheduler step (see
  :class:`~kvcompose.metrics.table.CallTable`), so merging the workers' stats
  takes the union vLLM takes;
- every failure a child call raised (from its guard, timed or not).

Threads: vLLM 0.30-0.33 calls a connector from one thread per process. Folding,
counting, errors and taking the stats hold a lock; a timed call appends one
tuple (atomic). Sampling keeps its countdown without a lock: calls made from
several threads at once are all counted, but their weights may be off by the
calls that raced.
"""

from __future__ import annotations

import inspect
import threading
from bisect import bisect_left
from collections.abc import Callable, Collection, Iterable, Sequence
from time import monotonic, perf_counter
from types import CellType
from typing import Any

from kvcompose.metrics.table import COUNTERS, OPS, CallTable, Cells, ErrorCounts, LoadErrors
from kvcompose.operations import FAILED_LOOKUP, Granularity, Operation

# From this many workers up, a worker ships its table dense: the scheduler then
# merges each worker's table in one array operation (see kvcompose.metrics.table).
DENSE_FROM_WORKERS = 8

# Timed calls kept unbucketed before they are folded into the table; bounds the
# memory of a process whose stats nobody takes (vLLM takes them every step).
MAX_PENDING_CALLS = 1 << 16

# After the engine was idle, an operation whose last timed call is older than this has its next call timed:
# a lightly loaded engine still shows each operation's latency every second or so.
RESAMPLE_AFTER_S = 1.0

_NO_COUNTS = [0] * len(COUNTERS)
_HITS, _MISSES, _MATCHED, _LOADED = (COUNTERS.index(name) for name in (
    "lookup_hits", "lookup_misses", "matched_tokens", "loaded_tokens"))

# A call of the composite's method, with its own signature: counted down, and passed to ``sampled`` when it
# is the one to time. Generated per signature (as dataclasses does) so that the untimed call, nearly every
# call, packs no ``*args``.
_COUNTDOWN = """
def countdown(function, instance, sampled):
    left = 1
    def call({parameters}):
        nonlocal left
        left -= 1
        if left:
            return function(instance, {arguments})
        return sampled({arguments})
    return call
"""


def _call_shape(method: Callable[..., Any]) -> tuple[str, str]:
    """(parameters, arguments) of ``method``'s signature, as source text."""
    parameters, arguments = [], []
    for parameter in inspect.signature(method).parameters.values():
        if parameter.kind is parameter.VAR_POSITIONAL:
            text = f"*{parameter.name}"
            parameters.append(text)
            arguments.append(text)
        elif parameter.kind is parameter.VAR_KEYWORD:
            text = f"**{parameter.name}"
            parameters.append(text)
            arguments.append(text)
        elif parameter.kind is parameter.KEYWORD_ONLY:
            raise TypeError(f"cannot count down {method!r}: keyword-only parameter {parameter.name!r}")
        else:
            parameters.append(parameter.name)
            arguments.append(parameter.name)
    return ", ".join(parameters), ", ".join(arguments)


class OperationSampler:
    """Which calls of one composite operation are timed, and how many calls each timed one stands for."""

    def __init__(self, index: int, every: int, pending: list[Any], fold: Callable[[], None]) -> None:
        self.index = index
        self.every = every
        # (slot, cell, seconds) of each child its last timed call timed (known once folded): where the calls
        # after it are credited.
        self.last_call: list[tuple[int, int, float]] = []
        self.timed_calls = 0  # since the recorder last looked (see PipelineRecorder.flush)
        self._pending = pending
        self._fold = fold
        self._period = 1  # the countdown's value when it last started again
        self._credited = 0  # calls of this period already credited (by an idle flush)
        # The countdown (calls left until the next timed one), kept in the counted-down call's closure cell and
        # read and written here through the cell, without a call; a cell of its own until :meth:`around`.
        self._left = CellType(1)

    def around(self, forward: Callable[..., Any], sampled: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` (a bound method), counted down: every ``every``-th call goes to ``sampled`` instead
        (the first call too)."""
        parameters, arguments = _call_shape(forward)
        namespace: dict[str, Any] = {}
        exec(_COUNTDOWN.format(parameters=parameters, arguments=arguments), namespace)  # noqa: S102
        call = namespace["countdown"](forward.__func__, forward.__self__, sampled)
        self._left = call.__closure__[call.__code__.co_freevars.index("left")]
        return call

    def begin(self) -> None:
        """A timed call starts (the countdown ran out with it): it stands for every call since the last one
        credited, itself included. The countdown starts again."""
        calls = self._period
        if len(self._pending) >= MAX_PENDING_CALLS:
            self._fold()
        self._pending.append((-1, calls - self._credited, self.index))  # the timed calls that follow weigh this
        self._left.cell_contents = self.every
        self._period, self._credited = self.every, 0
        self.timed_calls += 1

    def count_traced(self) -> bool:
        """A traced call, counted like any other; True if the countdown runs out with it: it is then the one
        to time, and begins the sample."""
        cell = self._left
        if (left := cell.cell_contents) > 1:
            cell.cell_contents = left - 1
            return False
        self.begin()
        return True

    def take_uncredited(self) -> int:
        """Calls since the last timed call that no flush credited yet; they count as credited now."""
        calls = self._period - self._left.cell_contents - self._credited
        self._credited += calls
        return calls

    def time_next(self) -> None:
        """The next call is timed (everything before it has been credited)."""
        self._left.cell_contents = 1
        self._period, self._credited = 1, 0


class PipelineRecorder:
    """Every child's calls in this process since the last :meth:`take`; records nothing when metrics are off."""

    def __init__(
        self, enabled: bool, bounds: Sequence[float], child_names: Sequence[str], per_layer: bool = False,
        ship_dense: bool = False, sample_every: int = 1,
    ) -> None:
        self.enabled = enabled
        self.per_layer = per_layer
        self.sample_every = sample_every
        self._ship_dense = ship_dense
        self._children = tuple(child_names)
        self._bounds = tuple(bounds)
        self._lock = threading.Lock()
        self._bucketed: Cells = {}  # calls folded since the last take
        # Not yet folded, filled in place (timed calls hold a reference): a timed call's (slot, seconds),
        # slot = child * len(OPS) + op, after the (-1, weight, sampler) its sampled call began with.
        self._pending: list[tuple[Any, ...]] = []
        self._samplers: dict[str, OperationSampler] = {}
        self._resampled_at = 0.0  # monotonic time flush last looked for operations not timed lately
        self._counts = [[0] * len(COUNTERS) for _ in self._children]
        self._errors: ErrorCounts = {}
        self._load_errors: LoadErrors = {}
        self._counted = False  # counters, errors or credited calls since the last take (read without the lock)

    # ---- timing ----

    def label(self, operation: Operation) -> str | None:
        """The ``op`` label of a timed operation; None if it is not timed."""
        if not self.enabled or (operation.granularity is Granularity.LAYER and not self.per_layer):
            return None
        return operation.label

    def sampler(self, operation: Operation) -> OperationSampler | None:
        """The sampler of a timed operation (one per composite operation); None if it is not timed."""
        if self.label(operation) is None:
            return None
        if (sampler := self._samplers.get(operation.name)) is None:
            sampler = self._samplers[operation.name] = OperationSampler(
                len(self._samplers), self.sample_every, self._pending, self._fold)
        return sampler

    def timed(self, child_name: str, operation: Operation, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call``, timed; ``call`` itself if the operation is not timed."""
        op = self.label(operation)
        if op is None:
            return call
        slot = self._children.index(child_name) * len(OPS) + OPS.index(op)
        append = self._pending.append
        # Two bodies, alike on purpose: packing an empty **kwargs costs a tenth of a timed call.
        if operation.keywords:

            def timed(*args: Any, **kwargs: Any) -> Any:
                start = perf_counter()
                try:
                    return call(*args, **kwargs)
                finally:
                    append((slot, perf_counter() - start))

        else:

            def timed(*args: Any) -> Any:
                start = perf_counter()
                try:
                    return call(*args)
                finally:
                    append((slot, perf_counter() - start))

        timed.__wrapped__ = call  # type: ignore[attr-defined]
        return timed

    def flush(self) -> None:
        """The engine goes idle: every operation's calls since its last timed call go to that call's bucket.
        An operation not timed since flush last looked, :data:`RESAMPLE_AFTER_S` or more ago, has its next
        call timed."""
        if not self.enabled:
            return
        now = monotonic()
        resample = now - self._resampled_at >= RESAMPLE_AFTER_S
        with self._lock:
            self._fold_pending()
            for sampler in self._samplers.values():
                if calls := sampler.take_uncredited():
                    for _, cell, seconds in sampler.last_call:
                        counts = self._bucketed.setdefault(cell, [0, 0.0])
                        counts[0] += calls
                        counts[1] += calls * seconds
                        self._counted = True
                if resample:
                    if not sampler.timed_calls:
                        sampler.time_next()
                    sampler.timed_calls = 0
        if resample:
            self._resampled_at = now

    # ---- what the calls meant, told by the instrumentation ----

    def request_admitted(
        self, answers: Sequence[tuple[int, bool]], loaders: Sequence[int], loading: int | None,
        external_tokens: int,
    ) -> None:
        """vLLM allocated the request's blocks: count its last lookup round (``answers``, one per loader, whose
        child indices ``loaders`` lists), and the tokens the child at index ``loading`` (None: no child) loads."""
        if not self.enabled:
            return
        with self._lock:
            for child, answer in zip(loaders, answers, strict=False):
                if answer is FAILED_LOOKUP:
                    continue
                counts = self._counts[child]
                if answer[0] > 0:
                    counts[_HITS] += 1
                    counts[_MATCHED] += answer[0]
                else:
                    counts[_MISSES] += 1
            if loading is not None:
                self._counts[loading][_LOADED] += external_tokens
            self._counted = True

    def count_load_errors(self, child_name: str, step: int, block_ids: Collection[int]) -> None:
        """Blocks the child failed to load in scheduler step ``step`` (reported by it, or
        given back to vLLM by kvcompose after it failed)."""
        if self.enabled and block_ids:
            with self._lock:
                self._load_errors.setdefault(child_name, {}).setdefault(step, set()).update(block_ids)
                self._counted = True

    def count_error(self, child_name: str, operation: Operation, error: Exception) -> None:
        """A child call raised ``error`` (told by the child's guard, whether the call was timed or not)."""
        if self.enabled:
            op, error_type = operation.label or operation.name, type(error).__name__
            with self._lock:
                by_type = self._errors.setdefault(child_name, {}).setdefault(op, {})
                by_type[error_type] = by_type.get(error_type, 0) + 1
                self._counted = True

    # ---- handing the stats over ----

    def take(self) -> CallTable | None:
        """The calls since the last take (None if there were none), then start afresh."""
        if not (self._pending or self._counted or self._bucketed):
            return None
        with self._lock:
            self._counted = False
            self._fold_pending()
            counters = [count for child_counts in self._counts for count in child_counts]
            table = CallTable(self._children, len(self._bounds) + 1, self._bucketed, counters, self._errors,
                              self._load_errors)
            self._bucketed, self._errors, self._load_errors = {}, {}, {}
            for child_counts in self._counts:
                child_counts[:] = _NO_COUNTS
        if self._ship_dense:
            table.densify()
        return table

    def _fold(self) -> None:
        with self._lock:
            self._fold_pending()

    def _fold_pending(self) -> None:
        """Sort the timed calls into their cells, for the next take (holding the lock). Calls appended
        meanwhile by other threads land after the ones taken, and stay."""
        if not self._pending:
            return
        entries = self._pending[:]
        del self._pending[: len(entries)]
        fold_timed_calls(entries, self._bounds, self._bucketed, list(self._samplers.values()))


def fold_timed_calls(
    entries: Iterable[tuple[Any, ...]], bounds: Sequence[float], into: Cells, samplers: Sequence[OperationSampler],
) -> None:
    """Add each timed call (slot, seconds) to the cell of its slot and bucket, as many times as the weight of
    the sampled call it belongs to: the latest (-1, weight, sampler index) before it (weight 1 before any).
    Bucket ``i`` holds ``bounds[i-1] < v <= bounds[i]`` (Prometheus' ``le``), the last one the rest. Each
    sampled call's timed calls become its sampler's ``last_call``."""
    buckets = len(bounds) + 1
    weight, last_call = 1, None  # before any sampled call: weight 1, and no sampler keeps the calls
    for entry in entries:
        slot = entry[0]
        if slot < 0:  # a sampled call begins
            weight = entry[1]
            last_call = samplers[entry[2]].last_call = []
            continue
        latency = entry[1]
        cell = slot * buckets + bisect_left(bounds, latency)
        if (counts := into.get(cell)) is None:
            into[cell] = [weight, weight * latency]
        else:
            counts[0] += weight
            counts[1] += weight * latency
        if last_call is not None:
            last_call.append((slot, cell, latency))
