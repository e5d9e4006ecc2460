"""Reading a pipeline file: YAML or JSON, with the line of every field."""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from kvcompose.errors import FieldPath, PipelineConfigError, Problem

LineMap = dict[FieldPath, int]


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                raise yaml.constructor.ConstructorError(
                    None, None, "a list or mapping cannot be a key", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_pipeline_source(path: Path) -> tuple[Any, LineMap, str]:
    """Parse ``path`` (YAML; JSON is read the same way) into data and a line map."""
    label = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PipelineConfigError([Problem((), "file not found")], label) from None
    except IsADirectoryError:
        raise PipelineConfigError([Problem((), "is a directory, not a pipeline file")], label) from None
    except PermissionError:
        raise PipelineConfigError([Problem((), "file is not readable (permission denied)")], label) from None
    except (OSError, UnicodeDecodeError) as error:
        raise PipelineConfigError([Problem((), f"cannot read file: {error}")], label) from None
    try:
        data, lines = _parse(text)
    except yaml.reader.ReaderError as error:  # a control character such as NUL
        line = text.count("\n", 0, error.position) + 1
        message = f"malformed YAML/JSON: character #x{error.character:04x} is not allowed in YAML"
        raise PipelineConfigError([Problem((), message, line)], label) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        reason = getattr(error, "problem", None) or str(error)
        raise PipelineConfigError([Problem((), f"malformed YAML/JSON: {reason}", line)], label) from None
    except RecursionError:
        message = "the document nests too deeply, or an alias (*name) refers to its own anchor (&name)"
        raise PipelineConfigError([Problem((), message)], label) from None
    return data, lines, label


def _parse(text: str) -> tuple[Any, LineMap]:
    loader = _StrictLoader(text)  # raises ReaderError for control characters
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    lines: LineMap = {}
    if node is not None:
        _collect_lines(node, (), lines)
    return data, lines


def _collect_lines(node: yaml.Node, path: FieldPath, lines: LineMap) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child_path = (*path, key_node.value)
            _collect_lines(value_node, child_path, lines)
            lines[child_path] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _collect_lines(item, (*path, index), lines)
