"""The one error type a pipeline file can raise, with field paths and lines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FieldPath = tuple[str | int, ...]

_SHOWN_LENGTH = 60


def shown(value: Any) -> str:
    """``repr(value)`` cut to a readable length, for quoting user input in a message."""
    return _cut(repr(value))


def _cut(text: str) -> str:
    return text if len(text) <= _SHOWN_LENGTH else f"{text[:_SHOWN_LENGTH - 3]}..."


def format_path(path: FieldPath) -> str:
    """Render ``("children", 1, "connector")`` as ``children[1].connector``."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{_cut(str(part))}" if text else _cut(str(part))
    return text


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a pipeline: where it is and what to do about it.

    A ``warning`` is something that may be wrong, which the checking
    environment cannot tell (an out-of-tree module where vLLM is not installed).
    """

    path: FieldPath
    message: str
    line: int | None = None
    warning: bool = False

    def describe(self, source: str | None = None) -> str:
        """One line: ``source:line: field.path: message`` (``warning: message`` for a warning)."""
        prefix = source or ""
        if self.line is not None:
            prefix = f"{prefix}:{self.line}" if prefix else f"line {self.line}"
        parts = [prefix] if prefix else []
        if self.path:
            parts.append(format_path(self.path))
        message = f"warning: {self.message}" if self.warning else self.message
        return " ".join(": ".join([*parts, message]).splitlines())


class PipelineConfigError(Exception):
    """A pipeline file or mapping that kvcompose cannot use.

    ``problems`` lists every problem found, each naming its field path and,
    for files, its line. ``str(error)`` gives one line per problem.
    """

    def __init__(self, problems: Sequence[Problem], source: str | None = None) -> None:
        self.problems = tuple(problems)
        self.source = source
        super().__init__("\n".join(p.describe(source) for p in self.problems))
