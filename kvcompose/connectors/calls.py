"""The calls the composite makes into its children: per operation, a tuple of callables in pipeline order.

The composite's loops iterate ``self._calls.<operation>`` and nothing else, as
MultiConnector's loops iterate its connectors. Each tuple holds one call per
child that takes part in the operation (``Operation.children``: every child,
the loaders or the savers; a per-layer operation leaves out a child whose
circuit is not closed, as a probe is never a per-layer call;
``Operation.skip_inherited`` leaves out a child that keeps the base class's
constant answer).

A call is the child's bound method, gated by its circuit breaker while the
breaker has something to do (:meth:`~kvcompose.connectors.isolation.ChildGuard.gate`)
and, for a result iterated after the call, isolated while it is iterated.
With an ``observe`` wrapper (the instrumentation's: see
:mod:`kvcompose.instrumentation`) each call is also made in an observed form,
around the gate, so that a call the breaker skips is seen too.

The calls are made again when a child's breaker changes how they must be made
(:meth:`ChildCalls.rebuild`) and handed to every view of them: the plain and
observed :class:`Fanout`, and any view the instrumentation adds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvcompose.operations import CHILD_OPERATIONS, OPERATIONS, Granularity, Operation

if TYPE_CHECKING:
    from kvcompose.connectors.children import Child

Calls = tuple[Callable[..., Any], ...]
# (child, operation, call) -> the call, observed
CallWrapper = Callable[["Child", Operation, Callable[..., Any]], Callable[..., Any]]


class CallsView(Protocol):
    def update(self, operation: str, plain: Calls, observed: Calls) -> None:
        """The operation's calls, as they are made now."""
        ...


class Fanout:
    """One tuple of calls per forwarded operation, all plain or all observed."""

    __slots__ = (*CHILD_OPERATIONS, "observed")

    def __init__(self, observed: bool = False) -> None:
        self.observed = observed
        for operation in CHILD_OPERATIONS:
            setattr(self, operation, ())

    def update(self, operation: str, plain: Calls, observed: Calls) -> None:
        setattr(self, operation, observed if self.observed else plain)


class ChildCalls:
    """Every child's calls of every forwarded operation; see the module docstring."""

    def __init__(self, children: Sequence[Child], observe: CallWrapper | None = None) -> None:
        self.children = tuple(children)
        self._observe = observe
        self.plain = Fanout()
        self.observed = Fanout(observed=True) if observe is not None else None
        self._views: list[CallsView] = [view for view in (self.plain, self.observed) if view is not None]
        self._made: dict[tuple[int, str], tuple[Callable[..., Any], Callable[..., Any]]] = {}
        self._tuples: dict[str, tuple[Calls, Calls]] = {}  # operation -> (plain, observed)
        self._owners: dict[Callable[..., Any], tuple[Operation, Child]] = {}
        # The owners as they were before the last rebuild: a call can change its own breaker's state, and with
        # it how its child's calls are made, before it raises (a half-open circuit's probe).
        self._retired: dict[Callable[..., Any], tuple[Operation, Child]] = {}
        self.rebuild()

    def add_view(self, view: CallsView) -> None:
        """``view`` is handed every operation's calls now, and again whenever they are made again."""
        self._views.append(view)
        for operation, (plain, observed) in self._tuples.items():
            view.update(operation, plain, observed)

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
            self._made = {key: calls for key, calls in self._made.items() if key[0] != child.index}
        self._retired, self._owners = self._owners, {}
        for name in CHILD_OPERATIONS:
            operation = OPERATIONS[name]
            plain, observed = [], []
            for taking_part in self.children:
                if (made := self._calls_of(taking_part, operation)) is not None:
                    plain.append(made[0])
                    observed.append(made[1])
                    self._owners[made[0]] = self._owners[made[1]] = (operation, taking_part)
            self._tuples[name] = (tuple(plain), tuple(observed))
            for view in self._views:
                view.update(name, *self._tuples[name])

    def _calls_of(self, child: Child, operation: Operation) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
        """The child's (plain, observed) call of the operation; None where it takes no part."""
        if not self._takes_part(child, operation):
            return None
        key = (child.index, operation.name)
        if (made := self._made.get(key)) is None:
            method = getattr(child.connector, operation.name, None)
            if method is None:
                return None  # a child class from before vLLM added the operation: never called
            gated = child.guard.gate(operation, method)
            plain = child.guard.isolating(operation, gated)
            observed = plain if self._observe is None else child.guard.isolating(
                operation, self._observe(child, operation, gated))
            made = self._made[key] = (plain, observed)
        return made

    @staticmethod
    def _takes_part(child: Child, operation: Operation) -> bool:
        if (operation.children == "loaders" and not child.load) or (operation.children == "savers" and not child.save):
            return False
        if operation.skip_inherited and child.inherits(operation.name):
            return False
        if operation.granularity is Granularity.LAYER:  # a probe is never a per-layer call
            return child.guard.closed
        return True
