"""``${VAR}`` and ``${VAR:-default}`` in the string values of a pipeline."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from kvcompose.errors import FieldPath, PipelineConfigError, Problem

# $${...} stays literal (as "${...}"), so a value can hold the characters themselves.
_REFERENCE = re.compile(r"\$(\$)?\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate_env(data: Any, environ: Mapping[str, str] | None = None) -> Any:
    """Return ``data`` with environment references in string values replaced.

    An unset variable without a default is an error naming the field.
    """
    env = os.environ if environ is None else environ
    problems: list[Problem] = []
    result = _walk(data, (), env, problems)
    if problems:
        raise PipelineConfigError(problems)
    return result


def _walk(value: Any, path: FieldPath, env: Mapping[str, str], problems: list[Problem]) -> Any:
    if isinstance(value, str):
        return _substitute(value, path, env, problems)
    if isinstance(value, dict):
        return {k: _walk(v, (*path, k), env, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, (*path, i), env, problems) for i, v in enumerate(value)]
    return value


def _substitute(text: str, path: FieldPath, env: Mapping[str, str], problems: list[Problem]) -> str:
    def replace(match: re.Match[str]) -> str:
        escaped, name, default = match.groups()
        if escaped:
            return match.group(0)[1:]
        if name in env:
            return env[name]
        if default is not None:
            return default
        problems.append(Problem(path, f"environment variable {name} is not set (use ${{{name}:-default}})"))
        return ""

    return _REFERENCE.sub(replace, text)
