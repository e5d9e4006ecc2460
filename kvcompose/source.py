"""Reading a pipeline file: YAML or JSON, with the line of every field.

Reading is bounded, so no input can hang the loader or exhaust memory: only
regular files of at most :data:`MAX_FILE_BYTES` are read, and a document may
hold at most :data:`MAX_NODES` values, keys and list items, nested at most
:data:`MAX_DEPTH` levels, counted as if every alias (``*name``) were written
out in full. The node graph is composed without recursion, and measured by a walk that
stops at the bounds before anything else walks it.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kvcompose.errors import FieldPath, PipelineConfigError, Problem, shown



class _PurePythonEvents(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser):
    """PyYAML's own event parser, for PyYAML builds without libyaml."""

    def __init__(self, text: str) -> None:
        yaml.reader.Reader.__init__(self, text)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)


_EventParser: Callable[[str], Any]
try:
    from yaml.cyaml import CParser as _EventParser  # libyaml, where PyYAML was built with it
except ImportError:  # pragma: no cover - depends on how PyYAML was built
    _EventParser = _PurePythonEvents

MAX_FILE_BYTES = 1024 * 1024
MAX_NODES = 20_000
MAX_DEPTH = 64
STDIN_LABEL = "<stdin>"  # how problems in a pipeline read from standard input name their source
# How libyaml names its own nesting limit (1000 levels, in the libyaml of the PyYAML 6.0.4 wheels).
_LIBYAML_TOO_DEEP = "exceeded maximum nesting depth"

LineMap = dict[FieldPath, int]

_TAG = "tag:yaml.org,2002:"
_MERGE_TAG, _VALUE_TAG, _STR_TAG = f"{_TAG}merge", f"{_TAG}value", f"{_TAG}str"
_RETYPED_TAGS = frozenset(f"{_TAG}{name}" for name in ("null", "bool", "int", "float"))
_FILE_KINDS = {
    stat.S_ISDIR: "is a directory, not a pipeline file",
    stat.S_ISFIFO: "is a FIFO (named pipe), not a regular file",
    stat.S_ISCHR: "is a character device, not a regular file",
    stat.S_ISBLK: "is a block device, not a regular file",
    stat.S_ISSOCK: "is a socket, not a regular file",
}
_RESOLVER = yaml.resolver.Resolver()


@dataclass(frozen=True)
class PipelineDocument:
    """A pipeline as read, before environment references are resolved.

    ``quoted`` holds the paths of quoted (or block) scalars, which stay
    strings after substitution; ``problems`` the values that could not be
    read (bad dates, duplicate keys...), each already in ``data`` as None.
    """

    data: Any
    label: str | None = None
    lines: LineMap = field(default_factory=dict)
    quoted: frozenset[FieldPath] = frozenset()
    problems: tuple[Problem, ...] = ()

    def line_of(self, path: FieldPath) -> int | None:
        """The line of ``path``, or of its nearest parent the file has a line for."""
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path)


def read_pipeline_source(path: Path) -> PipelineDocument:
    """Parse ``path`` (YAML; JSON is read the same way) into a :class:`PipelineDocument`."""
    label = str(path)
    return _parse(_read_text(path, label), label)


def read_pipeline_stream(stream: BinaryIO, label: str = STDIN_LABEL) -> PipelineDocument:
    """Parse a pipeline read from ``stream`` (standard input), under the same bounds as a file."""
    return _parse(_decode(stream.read(MAX_FILE_BYTES + 1) or b"", label), label)


def _parse(text: str, label: str) -> PipelineDocument:
    if control := yaml.reader.Reader.NON_PRINTABLE.search(text):  # such as NUL
        message = f"malformed YAML/JSON: character #x{ord(control.group()):04x} is not allowed in YAML"
        raise PipelineConfigError([Problem((), message, text.count("\n", 0, control.start()) + 1)], label)
    try:
        root = _compose(text, label)
    except yaml.reader.ReaderError as error:
        raise PipelineConfigError([Problem((), f"malformed YAML/JSON: {error.reason}")], label) from None
    except yaml.MarkedYAMLError as error:
        line = error.problem_mark.line + 1 if error.problem_mark is not None else None
        if error.problem == _LIBYAML_TOO_DEEP:  # its scanner looks ahead of our bound in flow collections
            raise PipelineConfigError([_too_deep(line)], label) from None
        raise PipelineConfigError([Problem((), f"malformed YAML/JSON: {error.problem}", line)], label) from None
    if root is None:
        return PipelineDocument(None, label, {(): 1})
    _refuse_oversized(root, _node_children, label)
    lines, quoted, first_paths = _walk_fields(root)
    constructor = _Constructor(first_paths)
    data = constructor.construct_object(root)
    return PipelineDocument(data, label, lines, frozenset(quoted), tuple(constructor.problems))


def mapping_document(mapping: Mapping[str, Any]) -> PipelineDocument:
    """A pipeline given as a mapping (inline JSON, Python), under the same bounds as a file."""
    _refuse_oversized(mapping, _data_children, None)
    return PipelineDocument(dict(mapping))


def read_as_plain_scalar(text: str) -> Any:
    """``text`` as YAML reads an unquoted scalar: null, booleans, integers and floats get their types.

    Anything else (dates included) stays the string. Raises ValueError for an
    integer past Python's digit limit.
    """
    tag = _RESOLVER.resolve(ScalarNode, text, (True, False))
    if tag not in _RETYPED_TAGS:
        return text
    node = ScalarNode(tag, text)
    try:
        return SafeConstructor.yaml_constructors[tag](_SCALARS, node)
    except ValueError as error:
        raise ValueError(_bad_scalar_message(node, error)) from None


def _read_text(path: Path, label: str) -> str:
    try:
        kind = os.stat(path).st_mode
        refusal = next((message for is_kind, message in _FILE_KINDS.items() if is_kind(kind)), None)
        if refusal is not None:
            raise PipelineConfigError([Problem((), refusal)], label)
        # O_NONBLOCK: a file swapped for a FIFO after the check cannot block the read.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(descriptor, "rb") as stream:
            raw = stream.read(MAX_FILE_BYTES + 1) or b""
    except FileNotFoundError:
        raise PipelineConfigError([Problem((), "file not found")], label) from None
    except PermissionError:
        raise PipelineConfigError([Problem((), "file is not readable (permission denied)")], label) from None
    except OSError as error:
        raise PipelineConfigError([Problem((), f"cannot read file: {error.strerror}")], label) from None
    except ValueError:  # a NUL in the path
        raise PipelineConfigError([Problem((), "cannot read file: the path holds a NUL character")], label) from None
    return _decode(raw, label)


def _decode(raw: bytes, label: str) -> str:
    if len(raw) > MAX_FILE_BYTES:
        message = f"file is larger than {MAX_FILE_BYTES // 2**20} MiB ({MAX_FILE_BYTES} bytes), the most read"
        raise PipelineConfigError([Problem((), message)], label)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        message = f"cannot read file: not UTF-8 text (byte 0x{raw[error.start]:02x} at offset {error.start})"
        raise PipelineConfigError([Problem((), message)], label) from None


def _compose(text: str, label: str) -> Node | None:
    """The node graph of the single document in ``text``, built without recursion.

    An alias is the node of its anchor (shared, not copied). An anchor is
    usable once its node is complete, so the graph has no cycles. Stops as
    soon as the text nests too deeply: libyaml's scanner slows down with the
    square of the nesting depth.
    """
    parser = _EventParser(text)
    anchors: dict[str, Node] = {}
    open_anchors: set[str] = set()
    stack: list[_OpenCollection] = []
    root: Node | None = None
    documents = nodes = 0
    while parser.check_event():
        event = parser.get_event()
        kind = type(event)
        node: Node | None = None
        if kind is yaml.ScalarEvent or kind is yaml.SequenceStartEvent or kind is yaml.MappingStartEvent:
            nodes += 1
            if nodes > MAX_NODES:  # even without aliases
                raise PipelineConfigError([_too_many()], label)
            if event.anchor is not None:
                _check_new_anchor(event, anchors, open_anchors)
            if kind is yaml.ScalarEvent:
                node = ScalarNode(_resolve_tag(event, ScalarNode, event.value), event.value, event.start_mark,
                                  event.end_mark, style=event.style)
                if event.anchor is not None:
                    anchors[event.anchor] = node
            else:
                collection_kind = SequenceNode if kind is yaml.SequenceStartEvent else MappingNode
                collection = collection_kind(_resolve_tag(event, collection_kind, None), [], event.start_mark, None,
                                             flow_style=event.flow_style)
                stack.append(_OpenCollection(collection, event.anchor))
                if len(stack) > MAX_DEPTH:
                    raise PipelineConfigError([_too_deep(event.start_mark.line + 1)], label)
                if event.anchor is not None:
                    open_anchors.add(event.anchor)
        elif kind is yaml.SequenceEndEvent or kind is yaml.MappingEndEvent:
            done = stack.pop()
            done.node.end_mark = event.end_mark
            node = done.node
            if done.anchor is not None:
                open_anchors.discard(done.anchor)
                anchors[done.anchor] = node
        elif kind is yaml.AliasEvent:
            node = _alias_target(event, anchors, open_anchors)
        elif kind is yaml.DocumentStartEvent:
            documents += 1
            if documents > 1:
                raise yaml.composer.ComposerError(None, None, "expected a single document in the file, found a "
                                                  "second one (---)", event.start_mark)
        if node is not None:
            if stack:
                stack[-1].add(node)
            else:
                root = node
    return root


@dataclass
class _OpenCollection:
    node: SequenceNode | MappingNode
    anchor: str | None
    pending_key: Node | None = None

    def add(self, child: Node) -> None:
        if isinstance(self.node, SequenceNode):
            self.node.value.append(child)
        elif self.pending_key is None:
            self.pending_key = child
        else:
            self.node.value.append((self.pending_key, child))
            self.pending_key = None


def _resolve_tag(event: Any, kind: type[Node], value: str | None) -> str:
    if event.tag is None or event.tag == "!":
        return str(_RESOLVER.resolve(kind, value, event.implicit))
    return str(event.tag)


def _alias_target(event: yaml.AliasEvent, anchors: dict[str, Node], open_anchors: set[str]) -> Node:
    if event.anchor in open_anchors:
        raise yaml.composer.ComposerError(None, None, f"the alias *{event.anchor} is used inside its own anchor "
                                          f"&{event.anchor}", event.start_mark)
    if event.anchor not in anchors:
        raise yaml.composer.ComposerError(None, None, f"the alias *{event.anchor} has no anchor "
                                          f"&{event.anchor} before it", event.start_mark)
    return anchors[event.anchor]


def _check_new_anchor(event: Any, anchors: dict[str, Node], open_anchors: set[str]) -> None:
    if event.anchor in anchors or event.anchor in open_anchors:
        raise yaml.composer.ComposerError(None, None, f"the anchor &{event.anchor} is defined twice",
                                          event.start_mark)


def _node_children(node: Any) -> list[Any]:
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return list(node.value) if isinstance(node, SequenceNode) else []


def _data_children(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [*value.keys(), *value.values()]
    return list(value) if isinstance(value, (list, tuple)) else []


def _refuse_oversized(root: Any, children: Callable[[Any], list[Any]], label: str | None) -> None:
    """Refuse a graph that is too large or too deep once shared parts are written out.

    Walks the graph as if every shared part were a copy, but stops at the
    first item past a bound, so it takes at most MAX_NODES steps however
    large the expansion would be. A mapping that contains itself is
    infinitely deep.
    """
    count = 0
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise PipelineConfigError([_too_many()], label)
        if depth > MAX_DEPTH:
            raise PipelineConfigError([_too_deep(None)], label)
        stack.extend((child, depth + 1) for child in children(item))


def _too_many() -> Problem:
    message = (f"the document holds more than {MAX_NODES} values, keys and list items (counting aliases as "
               f"written out); a pipeline may hold at most {MAX_NODES}")
    return Problem((), message)


def _too_deep(line: int | None) -> Problem:
    return Problem((), f"the document nests deeper than {MAX_DEPTH} levels (counting aliases as written out)", line)


def _walk_fields(root: Node) -> tuple[LineMap, set[FieldPath], dict[int, FieldPath]]:
    """Lines and quoted scalars by field path, and the first path of every node.

    A field's line is its key's line. Merged keys (``<<``) appear under the
    mapping that merges them; its own keys win, then the earlier merge source.
    """
    lines: LineMap = {(): root.start_mark.line + 1}
    quoted: set[FieldPath] = set()
    first_paths: dict[int, FieldPath] = {}

    def place_keys(node: MappingNode, path: FieldPath) -> None:  # every key, so a duplicate or bad one is placed
        for key_node, _ in node.value:
            first_paths.setdefault(id(key_node), (*path, key_node.value) if isinstance(key_node, ScalarNode) else path)

    def visit(node: Node, path: FieldPath) -> None:
        first_paths.setdefault(id(node), path)
        if isinstance(node, ScalarNode) and node.style:
            quoted.add(path)
        elif isinstance(node, MappingNode):
            place_keys(node, path)
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG:
                    for source in [value_node, *_merge_items(value_node)]:
                        first_paths.setdefault(id(source), path)
                        if isinstance(source, MappingNode):
                            place_keys(source, path)
            for key_node, value_node in _effective_pairs(node):
                child_path = (*path, key_node.value)
                visit(value_node, child_path)
                lines[child_path] = key_node.start_mark.line + 1
        elif isinstance(node, SequenceNode):
            for index, item in enumerate(node.value):
                child_path = (*path, index)
                lines[child_path] = item.start_mark.line + 1
                visit(item, child_path)

    visit(root, ())
    return lines, quoted, first_paths


def _effective_pairs(node: MappingNode) -> Iterator[tuple[ScalarNode, Node]]:
    """The scalar-keyed pairs of ``node`` with its (first) merge key applied, one per key."""
    merged: dict[str, tuple[ScalarNode, Node]] = {}
    explicit: dict[str, tuple[ScalarNode, Node]] = {}
    merge_value = next((value for key, value in node.value if key.tag == _MERGE_TAG), None)
    if merge_value is not None:
        for source in reversed(_merge_items(merge_value)):
            if isinstance(source, MappingNode):
                merged.update((key.value, (key, value)) for key, value in _effective_pairs(source))
    for key_node, value_node in node.value:
        if isinstance(key_node, ScalarNode) and key_node.tag != _MERGE_TAG:
            explicit.setdefault(key_node.value, (key_node, value_node))
    return iter({**merged, **explicit}.values())


def _merge_items(node: Node) -> list[Node]:
    """What the value of a merge key names: one mapping, or a list of them."""
    return list(node.value) if isinstance(node, SequenceNode) else [node]


class _Constructor(SafeConstructor):
    """SafeConstructor that records every unreadable value as a :class:`Problem` and goes on.

    A value that cannot be read becomes None in the data. Duplicate keys are
    refused (the first is kept); merge keys (``<<``) are applied.
    """

    def __init__(self, first_paths: Mapping[int, FieldPath]) -> None:
        super().__init__()
        self.deep_construct = True  # every collection is complete when construct_object returns
        self.problems: list[Problem] = []
        self._first_paths = first_paths
        self._failed: set[Node] = set()

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node)
        except ConstructorError as error:
            message = str(error.problem or error)
        except (ValueError, TypeError, LookupError, AttributeError, ArithmeticError) as error:  # e.g. !!int ""
            message = _bad_scalar_message(node, error)
        self.recursive_objects.pop(node, None)
        self.constructed_objects[node] = None
        self._failed.add(node)
        self._problem(node, message)
        return None

    def construct_mapping(self, node: Node, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, MappingNode):
            raise ConstructorError(None, None, f"expected a mapping, found a {node.id}", node.start_mark)
        merged: dict[Any, Any] = {}
        explicit: dict[Any, Any] = {}
        first_lines: dict[Any, int] = {}
        merge_line: int | None = None
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == _MERGE_TAG:
                if merge_line is not None:
                    self._problem(key_node, f"duplicate key '<<' (first at line {merge_line})")
                    continue
                merge_line = line
                for source in reversed(self._merged_mappings(key_node, value_node)):
                    merged.update(source)
                continue
            if key_node.tag == _VALUE_TAG:
                key_node.tag = _STR_TAG  # a lone "=" key, as PyYAML reads it
            key = self.construct_object(key_node)
            if key_node in self._failed:
                continue
            if not _hashes(key):
                self._problem(key_node, "a list or mapping cannot be a key")
            elif key in first_lines:
                self._problem(key_node, f"duplicate key {shown(key)} (first at line {first_lines[key]})")
            else:
                first_lines[key] = line
                explicit[key] = self.construct_object(value_node)
        return {**merged, **explicit}

    def _merged_mappings(self, key_node: Node, value_node: Node) -> list[dict[Any, Any]]:
        mappings = []
        for source in _merge_items(value_node):
            value = self.construct_object(source)
            if isinstance(value, dict):
                mappings.append(value)
            elif source not in self._failed:
                self._problem(key_node, "'<<' merges mappings: write '<<: *name' or '<<: [*name1, *name2]'")
        return mappings

    def _problem(self, node: Node, message: str) -> None:
        path = self._first_paths.get(id(node), ())
        self.problems.append(Problem(path, message, node.start_mark.line + 1))


def _hashes(key: Any) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def _bad_scalar_message(node: Node, error: Exception) -> str:
    tag = str(node.tag).removeprefix(_TAG)
    text = node.value if isinstance(node.value, str) else ""
    if tag == "int" and isinstance(error, ValueError) and len(text) > sys.get_int_max_str_digits():
        limit = sys.get_int_max_str_digits()
        return f"an integer of more than {limit} digits is not accepted; quote it to keep it as text"
    expected = {
        "int": "an integer",
        "float": "a number",
        "bool": "a boolean (true/false, yes/no, on/off)",
        "timestamp": "a date or timestamp (YYYY-MM-DD, optionally with a time)",
    }.get(tag, f"a valid !!{tag}")
    message = f"{shown(text)} is not {expected}"
    if tag == "timestamp" and isinstance(error, ValueError):
        message += f" ({error}); quote it to keep it as text"
    return message


_SCALARS = SafeConstructor()
