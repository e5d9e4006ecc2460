"""The calls the composite makes into its children: per operation, one tuple of callables in pipeline order.

The composite's loops iterate ``self._calls.<operation>`` and nothing else, as
MultiConnector's loops iterate its connectors. Each tuple holds one call per
child that takes part in the operation (``Operation.children``: every child,
the loaders or the savers; a per-layer operation leaves out a child whose
circuit is not closed, as a probe is never a per-layer call;
``Operation.skip_inherited`` leaves out a child that keeps the base class's
constant answer).

A call is the child's bound method, gated by its circuit breaker while the
breaker has something to do (:meth:`~kvcompose.connectors.isolation.ChildGuard.gate`),
observed by the instrumentation when the pipeline has one (timed, and traced
under its request or step: :meth:`~kvcompose.instrumentation.base.Instrumentation.observe`,
around the gate so that a call the breaker skips is seen too) and, for a
result iterated after the call, isolated while it is iterated.

The tuples are built once, when the composite is made, and again only for a
child whose breaker changes how its calls must be made (:meth:`ChildCalls.rebuild`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvcompose.operations import CHILD_OPERATIONS, OPERATIONS, Granularity, Operation

if TYPE_CHECKING:
    from kvcompose.child_spec import ChildSpec
    from kvcompose.connectors.children import Child

Calls = tuple[Callable[..., Any], ...]
# (child, operation, call) -> the call, observed
CallWrapper = Callable[["ChildSpec", Operation, Callable[..., Any]], Callable[..., Any]]


class Fanout:
    """One tuple of calls per forwarded operation: what the composite's loops iterate."""

    __slots__ = CHILD_OPERATIONS

    def __init__(self) -> None:
        for operation in CHILD_OPERATIONS:
            setattr(self, operation, ())


class ChildCalls:
    """Every child's calls of every forwarded operation; see the module docstring."""

    def __init__(self, children: Sequence[Child], observe: CallWrapper | None = None) -> None:
        self.children = tuple(children)
        self._observe = observe
        self.fanout = Fanout()
        self._made: dict[tuple[int, str], Callable[..., Any]] = {}
        self._owners: dict[Callable[..., Any], tuple[Operation, Child]] = {}
        # The owners as they were before the last rebuild: a call can change its own breaker's state, and with
        # it how its child's calls are made, before it raises (a half-open circuit's probe).
        self._retired: dict[Callable[..., Any], tuple[Operation, Child]] = {}
        self.rebuild()

    def owner(self, call: Callable[..., Any]) -> Child:
        """The child whose call this is."""
        found = self.find(call)
        assert found is not None, "every call the composite makes is one of its children's"
        return found[1]

    def find(self, call: Any) -> tuple[Operation, Child] | None:
        """The operation and child of a call the composite makes (or made before the last rebuild); None if
        ``call`` is none of them."""
        try:
            return self._owners.get(call) or self._retired.get(call)
        except TypeError:  # not hashable: not a call
            return None

    def rebuild(self, child: Child | None = None) -> None:
        """Make ``child``'s calls (every child's: None) again, as its guard has them made now."""
        if child is None:
            self._made.clear()
        else:
            self._made = {key: call for key, call in self._made.items() if key[0] != child.index}
        self._retired, self._owners = self._owners, {}
        for name in CHILD_OPERATIONS:
            operation = OPERATIONS[name]
            calls = []
            for taking_part in self.children:
                if (call := self._call_of(taking_part, operation)) is not None:
                    calls.append(call)
                    self._owners[call] = (operation, taking_part)
            setattr(self.fanout, name, tuple(calls))

    def _call_of(self, child: Child, operation: Operation) -> Callable[..., Any] | None:
        """The child's call of the operation; None where it takes no part."""
        if not self._takes_part(child, operation):
            return None
        key = (child.index, operation.name)
        if (call := self._made.get(key)) is None:
            method = getattr(child.connector, operation.name, None)
            if method is None:
                return None  # a child class from before vLLM added the operation: never called
            call = child.guard.gate(operation, method)
            if self._observe is not None:
                call = self._observe(child.spec, operation, call)
            call = self._made[key] = child.guard.isolating(operation, call)
        return call

    @staticmethod
    def _takes_part(child: Child, operation: Operation) -> bool:
        if (operation.children == "loaders" and not child.load) or (operation.children == "savers" and not child.save):
            return False
        if operation.skip_inherited and child.inherits(operation.name):
            return False
        if operation.granularity is Granularity.LAYER:  # a probe is never a per-layer call
            return child.guard.closed
        return True
