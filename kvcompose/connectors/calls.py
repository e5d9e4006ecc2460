"""The calls the composite makes into its children: per operation, a tuple of callables in pipeline order.

The composite's loops iterate ``ChildCalls.current.<operation>`` and nothing
else, so forwarding costs what MultiConnector's loops cost. Each tuple holds one
call per child that takes part in the operation (``Operation.children``:
every child, the loaders or the savers; per-layer operations leave out a
child whose circuit is not closed, and no child saves a layer while
:attr:`ChildCalls.layer_saves` is off; ``Operation.skip_inherited`` leaves
out a child that keeps the base class's constant answer).

Each child's call is made here, at start-up and again whenever its breaker
changes how it must be made (:meth:`ChildCalls.rebuild`), in up to four
variants (:class:`Variant`: plain, timed, traced, timed and traced).
Innermost to outermost: the timer, the breaker's gate, the span, the tap (what
observers read from every call's result), and isolation of a result iterated
after the call (see :mod:`kvcompose.connectors.isolation`; the composite's loops
catch every other failure). With nothing to add, a call is the child's own
bound method.

The composite calls ``current``. Between calls it holds the ``resting`` calls:
the plain ones, or, while the instrumentation
(:mod:`kvcompose.connectors.instrumentation`) has a step traced, the traced ones
of the operations that step traces (:meth:`ChildCalls.trace_by_default`: a
switch of tuples, nothing wrapped or installed per step). For one call the
instrumentation puts another variant in its place: one sampled for timing runs
the ``timing`` calls (the resting ones, timed), and a call about a traced
request the traced ones. A call that raised is traced back to its child by
:meth:`ChildCalls.owner`, on the failure path only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcompose.operations import CHILD_OPERATIONS, OPERATIONS, Granularity, Operation

if TYPE_CHECKING:
    from kvcompose.connectors.children import Child

# (child, operation, call) -> the call wrapped, or ``call`` itself where the wrapper has nothing to add.
CallWrapper = Callable[["Child", Operation, Callable[..., Any]], Callable[..., Any]]


class Variant(enum.Flag):
    PLAIN = 0
    TIMED = enum.auto()  # its latency recorded
    TRACED = enum.auto()  # in a span


@dataclass(frozen=True)
class CallWrappers:
    """What the instrumentation adds to child calls; None: nothing."""

    timed: CallWrapper | None = None
    traced: CallWrapper | None = None
    tapped: CallWrapper | None = None  # every variant


class Fanout:
    """One tuple of calls per forwarded operation."""

    __slots__ = CHILD_OPERATIONS

    def __init__(self) -> None:
        for operation in CHILD_OPERATIONS:
            setattr(self, operation, ())


class ChildCalls:
    """Every child's calls of every operation, in each variant; see the module docstring."""

    def __init__(self, children: Sequence[Child], wrappers: CallWrappers | None = None) -> None:
        self.children = tuple(children)
        self._wrappers = wrappers or CallWrappers()
        self.current = Fanout()  # what the composite calls now
        self.resting = Fanout()  # what ``current`` holds between calls: plain, or traced in a traced step
        self.timing = Fanout()  # what a call sampled for timing runs: the resting calls, timed
        made = (Variant.TIMED if self._wrappers.timed is not None else Variant.PLAIN) | (
            Variant.TRACED if self._wrappers.traced is not None else Variant.PLAIN)
        self._variants = {variant: Fanout() for variant in (Variant.PLAIN, Variant.TIMED, Variant.TRACED,
                                                            Variant.TIMED | Variant.TRACED) if variant in made}
        self._plain = self._variants[Variant.PLAIN]
        # (resting, timing) fanouts of an operation at rest untraced, and traced (no Enum hashed in a step)
        self._untraced = (self._plain, self.fanout(Variant.TIMED))
        self._traced = (self.fanout(Variant.TRACED), self.fanout(Variant.TIMED | Variant.TRACED))
        self._traced_by_default: frozenset[str] = frozenset()
        self._owners: dict[str, dict[Callable[..., Any], Child]] = {}  # operation -> its calls' children
        # ... as they were before the last rebuild: a call can change its own breaker's state, and with it how
        # its child's calls are made, before it raises (a half-open circuit's probe).
        self._retired: dict[str, dict[Callable[..., Any], Child]] = {}
        self._made: dict[tuple[int, str, Variant], Callable[..., Any]] = {}  # (child, operation, variant) -> call
        # The composite stops layer saves for the rest of a step whose load failed (read here, every step;
        # changed by :meth:`set_layer_saves`).
        self.layer_saves = True
        # Called after the loaders' waits of every layer, while set (the transfer tracker marks sync loads' end).
        self._layer_load_marker: Callable[[str], None] | None = None
        self.rebuild()

    # ---- what the composite reads ----

    def owner(self, operation: Operation, call: Callable[..., Any]) -> Child:
        """The child whose call of ``operation`` this is."""
        child = self._owners[operation.name].get(call)
        return child if child is not None else self._retired[operation.name][call]

    def set_layer_saves(self, on: bool) -> None:
        if on != self.layer_saves:
            self.layer_saves = on
            self._rebuild_operation(OPERATIONS["save_kv_layer"])

    def trace_by_default(self, operations: frozenset[str]) -> None:
        """From now on, these operations rest on their traced calls (a traced step's), every other on its
        plain calls."""
        changed = operations ^ self._traced_by_default
        self._traced_by_default = operations
        self._rest(changed)  # twice in a traced step: one call, not one per operation

    def set_layer_load_marker(self, marker: Callable[[str], None] | None) -> None:
        """Call ``marker`` (None: nothing) after the loaders' waits of every layer, from now on."""
        previous, self._layer_load_marker = self._layer_load_marker, marker
        if marker is previous:
            return
        for fanout in self._variants.values():  # once or twice a step: no rebuild
            calls = fanout.wait_for_layer_load[:-1] if previous is not None else fanout.wait_for_layer_load
            fanout.wait_for_layer_load = calls + (marker,) if marker is not None else calls
        self._rest(("wait_for_layer_load",))

    def fanout(self, variant: Variant) -> Fanout:
        """The calls of ``variant`` (the plain ones where that variant is not made); rebuilt in place."""
        return self._variants.get(variant, self._plain)

    # ---- making the calls ----

    def rebuild(self, child: Child | None = None) -> None:
        """Make ``child``'s calls (every child's: None) again, as its guard has them made now."""
        if child is None:
            self._made.clear()
        else:
            self._made = {key: call for key, call in self._made.items() if key[0] != child.index}
        for operation in CHILD_OPERATIONS:
            self._rebuild_operation(OPERATIONS[operation])

    def _rebuild_operation(self, operation: Operation) -> None:
        name = operation.name
        taking_part = [child for child in self.children if self._takes_part(child, operation)]
        self._retired[name] = self._owners.get(name, {})
        owners = self._owners[name] = {}
        for variant, fanout in self._variants.items():
            calls = []
            for child in taking_part:
                if (call := self._call(child, operation, variant)) is None:
                    continue  # a child class from before vLLM added the operation: never called
                owners[call] = child
                calls.append(call)
            if name == "wait_for_layer_load" and self._layer_load_marker is not None:
                calls.append(self._layer_load_marker)
            setattr(fanout, name, tuple(calls))
        self._rest((name,))

    def _rest(self, names: Iterable[str]) -> None:
        """``current`` (and ``resting``, ``timing``) take these operations' calls as they rest now."""
        for name in names:
            resting, timing = self._traced if name in self._traced_by_default else self._untraced
            calls = getattr(resting, name)
            setattr(self.resting, name, calls)
            setattr(self.timing, name, getattr(timing, name))
            setattr(self.current, name, calls)

    def _takes_part(self, child: Child, operation: Operation) -> bool:
        if (operation.children == "loaders" and not child.load) or (operation.children == "savers" and not child.save):
            return False
        if operation.skip_inherited and child.inherits(operation.name):
            return False
        if operation.granularity is Granularity.LAYER:  # a probe is never a per-layer call
            return child.guard.closed and (operation.name != "save_kv_layer" or self.layer_saves)
        return True

    def _call(self, child: Child, operation: Operation, variant: Variant) -> Callable[..., Any] | None:
        key = (child.index, operation.name, variant)
        if (call := self._made.get(key)) is None:
            method = getattr(child.connector, operation.name, None)
            if method is not None:
                call = self._made[key] = self._make(child, operation, variant, method)
        return call

    def _make(
        self, child: Child, operation: Operation, variant: Variant, method: Callable[..., Any],
    ) -> Callable[..., Any]:
        wrappers, call = self._wrappers, method
        if Variant.TIMED in variant and wrappers.timed is not None:
            call = wrappers.timed(child, operation, call)
        call = child.guard.gate(operation, call)
        if Variant.TRACED in variant and wrappers.traced is not None:
            call = wrappers.traced(child, operation, call)
        if wrappers.tapped is not None:
            call = wrappers.tapped(child, operation, call)
        return child.guard.isolating(operation, call)
