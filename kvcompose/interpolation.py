"""``${VAR}`` and ``${VAR:-default}`` in the string values of a pipeline.

The syntax, read left to right:

- ``${NAME}``: the variable's value; an unset variable is an error.
- ``${NAME:-default}``: the default when the variable is unset. The default
  may itself hold references (``${A:-${B:-x}}``) and ends at the first ``}``
  that closes no reference inside it.
- ``$${`` writes a literal ``${``; a ``$`` before anything but ``{`` is kept.

Anything else after ``${`` (no name, a name starting with a digit, no closing
``}``) is an error naming the field, never left in the value as text.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvcompose.errors import FieldPath, Problem, shown
from kvcompose.source import read_as_plain_scalar

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_NESTING = 8


@dataclass(frozen=True)
class _Reference:
    name: str
    default: tuple[_Part, ...] | None


_Part = str | _Reference


class _Malformed(ValueError):
    def __init__(self, text: str, position: int, reason: str) -> None:
        snippet = shown(text[position:])
        super().__init__(f"malformed reference {snippet} at character {position + 1}: {reason} "
                         "(write ${NAME} or ${NAME:-default}; $${ writes a literal ${)")


def interpolate_env(
    data: Any,
    environ: Mapping[str, str] | None = None,
    retype: Callable[[FieldPath], bool] = lambda path: False,
) -> tuple[Any, list[Problem]]:
    """``data`` with environment references in string values replaced, and the problems found.

    Where ``retype(path)`` holds, a value that is exactly one reference is
    read as an unquoted YAML scalar would be (``false``, ``123``, ``1.5``,
    ``null`` get their types). A value with a problem is kept as written.
    """
    env = os.environ if environ is None else environ
    problems: list[Problem] = []
    result = _walk(data, (), env, retype, problems)
    return result, problems


def is_whole_reference(text: str) -> bool:
    """Whether ``text`` is exactly one well-formed ``${...}`` reference."""
    try:
        return _whole_reference(_parse(text)) is not None
    except _Malformed:
        return False


def _walk(value: Any, path: FieldPath, env: Mapping[str, str], retype: Callable[[FieldPath], bool],
          problems: list[Problem]) -> Any:
    if isinstance(value, str):
        return _substitute(value, path, env, retype, problems)
    if isinstance(value, dict):
        return {k: _walk(v, (*path, k), env, retype, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, (*path, i), env, retype, problems) for i, v in enumerate(value)]
    return value


def _substitute(text: str, path: FieldPath, env: Mapping[str, str], retype: Callable[[FieldPath], bool],
                problems: list[Problem]) -> Any:
    if "$" not in text:
        return text
    try:
        parts = _parse(text)
    except _Malformed as error:
        problems.append(Problem(path, str(error)))
        return text
    missing: list[str] = []
    result = _evaluate(parts, env, missing)
    for name in dict.fromkeys(missing):
        problems.append(Problem(path, f"environment variable {name} is not set (use ${{{name}:-default}})"))
    whole = _whole_reference(parts)
    if missing:
        return text
    if whole is None or not retype(path):
        return result
    try:
        return read_as_plain_scalar(result)
    except ValueError as error:
        problems.append(Problem(path, f"the value of ${{{whole.name}}} cannot be read: {error}"))
        return text


def _whole_reference(parts: tuple[_Part, ...]) -> _Reference | None:
    return parts[0] if len(parts) == 1 and isinstance(parts[0], _Reference) else None


def _evaluate(parts: tuple[_Part, ...], env: Mapping[str, str], missing: list[str]) -> str:
    pieces = []
    for part in parts:
        if isinstance(part, str):
            pieces.append(part)
        elif part.name in env:
            pieces.append(env[part.name])
        elif part.default is not None:
            pieces.append(_evaluate(part.default, env, missing))
        else:
            missing.append(part.name)
    return "".join(pieces)


def _parse(text: str) -> tuple[_Part, ...]:
    parts, _ = _parse_parts(text, 0, 0)
    return parts


def _parse_parts(text: str, start: int, depth: int) -> tuple[tuple[_Part, ...], int]:
    """Parts from ``start`` to the end of ``text`` (depth 0) or to the ``}`` closing a default.

    Returns the parts and the position where reading stopped.
    """
    parts: list[_Part] = []
    literal: list[str] = []
    position = start
    while position < len(text):
        dollar = text.find("$", position)
        close = text.find("}", position) if depth else -1
        if close != -1 and (dollar == -1 or close < dollar):
            literal.append(text[position:close])
            position = close
            break
        if dollar == -1:
            literal.append(text[position:])
            position = len(text)
            break
        literal.append(text[position:dollar])
        if text.startswith("$${", dollar):
            literal.append("${")
            position = dollar + 3
        elif text.startswith("${", dollar):
            if "".join(literal):
                parts.append("".join(literal))
            literal = []
            reference, position = _parse_reference(text, dollar, depth)
            parts.append(reference)
        else:
            literal.append("$")
            position = dollar + 1
    if literal and "".join(literal):
        parts.append("".join(literal))
    return tuple(parts), position


def _parse_reference(text: str, start: int, depth: int) -> tuple[_Reference, int]:
    """The reference starting with ``${`` at ``start``, and the position after its ``}``."""
    name = _NAME.match(text, start + 2)
    if name is None:
        raise _Malformed(text, start, "a variable name (letters, digits and _, not starting with a digit) "
                                      "must follow ${")
    after = name.end()
    if text.startswith("}", after):
        return _Reference(name.group(), None), after + 1
    if not text.startswith(":-", after):
        if after >= len(text):
            raise _Malformed(text, start, "no closing }")
        raise _Malformed(text, start, f"expected }} or :-default}} after ${{{name.group()}")
    if depth + 1 > MAX_NESTING:
        raise _Malformed(text, start, f"defaults nest more than {MAX_NESTING} references deep")
    default, end = _parse_parts(text, after + 2, depth + 1)
    if end >= len(text):
        raise _Malformed(text, start, "no closing }")
    return _Reference(name.group(), default), end + 1
