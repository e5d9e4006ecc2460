"""What a fan-out loop costs per child, by its shape, on plain Python classes: ``python -m benchmarks.loop_shapes``.

Not part of ``make bench``. The hot-path benchmark's bare ``wait_for_layer_load``
and ``wait_for_save`` are loops and nothing else, over children that do
nothing, so what separates kvcompose from MultiConnector there is the loop's
shape alone. This times the shapes apart, with no vLLM and no kvcompose:

- ``multi``: MultiConnector's (each child's method looked up and called);
- ``multi_twin``: the same again, as a second subject (how far two identical
  subjects read apart in this run);
- ``isolating``: MultiConnector's with each call in its own ``try``, as a
  composite that isolates its children must make it;
- ``prebound``: calls bound once, called from a tuple, no ``try``;
- ``kvcompose``: the composite's (pre-bound calls read from its table of calls,
  each in its own ``try``).

On CPython 3.11 a ``try`` is not free in a loop: it leaves a no-op instruction
in the loop's body (for the ``try`` line's line number), one more dispatch per
child, which also keeps the interpreter from fusing the loop variable's store
with its next load. A pre-bound call unpacks its method object on every call.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.timing import per_call_ns

CHILD_COUNTS = (2, 8)
SUBJECTS = ("multi", "multi_twin", "isolating", "prebound", "kvcompose")


class Child:
    def wait(self, layer_name: str) -> None:
        pass


class MultiShaped:
    def __init__(self, children: int) -> None:
        self._children = [Child() for _ in range(children)]

    def wait(self, layer_name: str) -> None:
        for child in self._children:
            child.wait(layer_name)


class Answering:
    """What an isolating loop calls when a child raises (never, here)."""

    def failed(self, error: Exception) -> None:
        raise AssertionError("no child fails here") from error


class Isolating(MultiShaped, Answering):
    def wait(self, layer_name: str) -> None:
        for child in self._children:
            try:
                child.wait(layer_name)
            except Exception as error:
                self.failed(error)


class Prebound:
    def __init__(self, children: int) -> None:
        self._calls = tuple(Child().wait for _ in range(children))

    def wait(self, layer_name: str) -> None:
        for call in self._calls:
            call(layer_name)


class CallTable:
    __slots__ = ("wait",)

    def __init__(self, children: int) -> None:
        self.wait = tuple(Child().wait for _ in range(children))


class KVComposeShaped(Answering):
    __slots__ = ("_calls",)

    def __init__(self, children: int) -> None:
        self._calls = CallTable(children)

    def wait(self, layer_name: str) -> None:
        for wait in self._calls.wait:
            try:
                wait(layer_name)
            except Exception as error:
                self.failed(error)


_CLASSES: dict[str, type[Any]] = {"multi": MultiShaped, "multi_twin": MultiShaped, "isolating": Isolating,
                                  "prebound": Prebound, "kvcompose": KVComposeShaped}


def measure(rounds: int = 9, sample_s: float = 0.05) -> list[dict[str, Any]]:
    """Per child count: ns per call of every shape, and each as a ratio to ``multi``."""
    rows = []
    for children in CHILD_COUNTS:
        subjects = {name: {"c": _CLASSES[name](children)} for name in SUBJECTS}
        ns = per_call_ns("c.wait('model.layers.0')", subjects, rounds=rounds, sample_s=sample_s)
        rows.append({"children": children, "ns": ns, "vs_multi": {name: ns[name] / ns["multi"] for name in SUBJECTS}})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| children | " + " | ".join(SUBJECTS) + " |", "|" + " --- |" * (len(SUBJECTS) + 1)]
    for row in rows:
        cells = [f"{row['ns'][name]:.0f} ({row['vs_multi'][name]:.2f}x)" for name in SUBJECTS]
        lines.append(f"| {row['children']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nns per call (ratio to multi), fastest of the rounds."


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loop_shapes", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    print(table(measure(parser.parse_args().rounds)))


if __name__ == "__main__":
    main()
