"""Fuzzing the pipeline loader and ``kvcompose validate``.

Arbitrary JSON/YAML-ish documents, token soup, mutations of
examples/pipeline.yaml, alias fan-outs, random YAML tags and random bytes go
through ``load_pipeline`` (mapping and file forms) and the CLI. The only
failure allowed is :class:`PipelineConfigError`, with every problem naming a
path and a message; the CLI exits 0 or 2 and never prints a traceback.

Every case has a deadline of 1 s (inputs are at most 64 KiB) and runs under
a hang guard, so an exponential case fails instead of stalling the suite.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvcompose.cli import main
from kvcompose.config import Pipeline, load_pipeline
from kvcompose.errors import PipelineConfigError

from .test_config_limits import VALID_HEAD, time_limit

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pipeline.yaml"
EXAMPLE_TEXT = EXAMPLE.read_text(encoding="utf-8")
EXAMPLE_DATA = yaml.safe_load(EXAMPLE_TEXT)

FUZZ = settings(max_examples=200, deadline=datetime.timedelta(seconds=1),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_INPUT_BYTES = 64 * 1024

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
keys = st.text(max_size=10) | st.sampled_from(["version", "name", "children", "connector", "config", "load", "role"])
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys | st.integers() | st.none(), inner, max_size=4),
    max_leaves=25,
)

# Pieces of YAML syntax, so random text reaches the parser's corners
# (anchors, tags, flow collections, complex keys, documents, NUL bytes).
YAML_TOKENS = [
    "version", "name", "children", "connector", "ExampleConnector", "config", "1", "x", ":", ": ", " ", "\n",
    "  ", "- ", "-", "{", "}", "[", "]", ",", "&a ", "*a", "!!str ", "!!binary ", "!!python/object ", "? ",
    "'", '"', "#", "${X}", "${X:-d}", "$${", "\t", "---\n", "...\n", "%YAML 1.1\n", "<<: *a", "|\n", ">\n",
    "~", "null", ".nan", "1e400", "\x00", "\ufeff", "\\", "é",
]
token_soup = st.lists(st.sampled_from(YAML_TOKENS) | st.text(max_size=3), max_size=40).map("".join)


@pytest.fixture(scope="module")
def pipeline_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "pipeline.yaml"


def assert_loads_or_config_error(source: Any) -> None:
    try:
        with time_limit():
            pipeline = load_pipeline(source)
    except PipelineConfigError as error:
        assert error.problems, "a PipelineConfigError without problems"
        for problem in error.problems:
            assert isinstance(problem.path, tuple)
            assert isinstance(problem.message, str) and problem.message.strip()
            assert problem.line is None or problem.line >= 1
            assert problem.describe(error.source)
    else:
        assert isinstance(pipeline, Pipeline)


def assert_cli_validates(path: Path) -> None:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), time_limit():
        code = main(["validate", str(path)])
    assert "Traceback" not in stderr.getvalue()
    if code == 0:
        assert stdout.getvalue().startswith("ok: ")
    else:
        assert code == 2 and stderr.getvalue().strip()


def check_text(path: Path, text: str, cli: bool = True) -> None:
    path.write_text(text, encoding="utf-8")
    assert path.stat().st_size <= MAX_INPUT_BYTES
    assert_loads_or_config_error(path)
    if cli:
        assert_cli_validates(path)


def check_document(path: Path, document: Any) -> None:
    if isinstance(document, dict):
        assert_loads_or_config_error(document)
    check_text(path, yaml.safe_dump(document))
    check_text(path, json.dumps(document), cli=False)  # JSON spellings: quoted keys, NaN, Infinity


@FUZZ
@given(document=documents)
def test_arbitrary_documents(pipeline_file: Path, document: Any) -> None:
    check_document(pipeline_file, document)


@FUZZ
@given(text=token_soup)
# Regressions: each of these crashed the loader with something other than PipelineConfigError.
@example(text="{[1]: 2}")  # a list as a mapping key (TypeError: unhashable type)
@example(text="? {a: 1}\n: 2\n")  # a mapping as a mapping key
@example(text="a: &x [*x]\n")  # an alias inside its own anchor (RecursionError)
@example(text="[" * 5000 + "]" * 5000)  # nesting deeper than Python's recursion limit
@example(text="version: 1\x00")  # a NUL byte (yaml.reader.ReaderError raised before parsing)
def test_yaml_token_soup(pipeline_file: Path, text: str) -> None:
    check_text(pipeline_file, text)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every location in a document, the root included."""
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*path, index))
    return found


def _mutate(document: Any, data: st.DataObject) -> Any:
    document = copy.deepcopy(document)
    path = data.draw(st.sampled_from(_paths(document)))
    if not path:
        return data.draw(documents)
    *parents, last = path
    parent = document
    for part in parents:
        parent = parent[part]
    action = data.draw(st.sampled_from(["delete", "replace", "add_key", "wrap", "retype_key"]))
    if action == "delete":
        del parent[last]
    elif action == "replace":
        parent[last] = data.draw(documents)
    elif action == "add_key" and isinstance(parent, dict):
        parent[data.draw(keys)] = data.draw(documents)
    elif action == "wrap":
        parent[last] = [parent[last]]
    elif action == "retype_key" and isinstance(parent, dict):
        parent[data.draw(st.integers() | st.none() | st.booleans())] = parent.pop(last)
    return document


@FUZZ
@given(data=st.data())
def test_mutations_of_the_example(pipeline_file: Path, data: st.DataObject) -> None:
    document = EXAMPLE_DATA
    for _ in range(data.draw(st.integers(1, 3))):
        document = _mutate(document, data)
    check_document(pipeline_file, document)


@FUZZ
@given(data=st.data())
def test_text_mutations_of_the_example(pipeline_file: Path, data: st.DataObject) -> None:
    text = EXAMPLE_TEXT
    for _ in range(data.draw(st.integers(1, 4))):
        start = data.draw(st.integers(0, len(text)))
        end = data.draw(st.integers(start, min(len(text), start + 20)))
        text = text[:start] + data.draw(token_soup) + text[end:]
    check_text(pipeline_file, text)


def test_the_unmutated_example_is_valid(pipeline_file: Path) -> None:
    # The mutation tests start from a valid file, so they probe the edges of validity.
    assert load_pipeline(EXAMPLE).name == "hot-then-cold"
    assert load_pipeline(EXAMPLE_DATA).children[1].name == "cold"
    check_text(pipeline_file, EXAMPLE_TEXT)


# Billion laughs and its relatives: levels of anchored collections, each made
# of aliases of the level below, as lists, mappings, merge keys or keys.
LEVEL_SHAPES = {
    "list": lambda below, width: "[" + ", ".join([f"*{below}"] * width) + "]",
    "mapping": lambda below, width: "{" + ", ".join(f"k{i}: *{below}" for i in range(width)) + "}",
    "merge": lambda below, width: "[" + ", ".join(f"{{<<: *{below}, k: {i}}}" for i in range(width)) + "]",
    "nested": lambda below, width: "[" * width + f"*{below}" + "]" * width,
}


@st.composite
def alias_fan_outs(draw: st.DrawFn) -> str:
    levels = draw(st.integers(1, 40))
    lines = ["      l0: &l0 {a: [lol, lol], b: lol}"]
    for level in range(1, levels):
        shape = draw(st.sampled_from(sorted(LEVEL_SHAPES)))
        lines.append(f"      l{level}: &l{level} " + LEVEL_SHAPES[shape](f"l{level - 1}", draw(st.integers(1, 12))))
    use = draw(st.sampled_from(["", f"      last: *l{levels - 1}\n", f"      ? *l{levels - 1}\n      : key\n"]))
    return VALID_HEAD + "\n".join(lines) + "\n" + use


@FUZZ
@given(text=alias_fan_outs())
def test_alias_fan_outs(pipeline_file: Path, text: str) -> None:
    check_text(pipeline_file, text)


TAGS = [
    "!!int", "!!float", "!!bool", "!!null", "!!str", "!!timestamp", "!!binary", "!!set", "!!omap", "!!pairs",
    "!!seq", "!!map", "!!merge", "!!value", "!!yaml", "!!python/object:os.system", "!!python/name:os.system",
    "!local", "!", "!<tag:yaml.org,2002:int>", "!<!>", "!!",
]
TAGGED_VALUES = [
    "abc", "1", "-0", "0x1F", "0o17", "017", "1_000", "1e400", ".nan", "-.inf", "2001-02-30", "2001-02-03",
    "2001-02-03T25:00:00", "2001-02-03 04:05:06 +99:00", "9" * 4301, "[1, 2]", "{a: 1}", "[{a: 1}, [b]]",
    "*a", "~", "''", "aGk=", "aGk", "yes", "maybe", "<<", "=", "", "[*a, *a]", "{<<: *a}",
]


def quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # raw characters: YAML does not join \u escapes of surrogate pairs


@st.composite
def tagged_documents(draw: st.DrawFn) -> str:
    entries = []
    for index in range(draw(st.integers(1, 6))):
        tag = draw(st.sampled_from(TAGS))
        value = draw(st.sampled_from(TAGGED_VALUES) | st.text(max_size=8).map(quoted))
        key = draw(st.sampled_from(["name", "load", "save", "role", "version", f"k{index}", "<<", "!!int k", "? x"]))
        entries.append((key, f"{tag} {value}"))
    where = draw(st.sampled_from(["config", "child", "top"]))
    anchor = "      anchor: &a {x: 1}\n"
    if where == "top":
        return "a: &a [1]\n" + "".join(f"{key}: {value}\n" for key, value in entries) + "version: 1\n"
    indent = "      " if where == "config" else "    "
    return VALID_HEAD + anchor + "".join(f"{indent}{key}: {value}\n" for key, value in entries)


@FUZZ
@given(text=tagged_documents())
@example(text=VALID_HEAD + "      name: !!int ''\n")  # IndexError inside PyYAML's int constructor
@example(text=VALID_HEAD + "      name: !!float\n")  # the same in its float constructor
def test_random_yaml_tags(pipeline_file: Path, text: str) -> None:
    check_text(pipeline_file, text)


@FUZZ
@given(raw=st.binary(max_size=2048) | st.builds(lambda byte, size: byte * size, st.binary(min_size=1, max_size=3),
                                                st.integers(1, MAX_INPUT_BYTES // 3)))
def test_random_bytes(pipeline_file: Path, raw: bytes) -> None:
    pipeline_file.write_bytes(raw)
    assert_loads_or_config_error(pipeline_file)
    assert_cli_validates(pipeline_file)


REPEATED_ITEMS = ["1", "!!int x", "2001-02-30", "a: 1", "'${'", "${U:-${V:-w}}", "*a", "[", "{x: *a}", "? *a\n: 1"]


@FUZZ
@given(item=st.sampled_from(REPEATED_ITEMS), separator=st.sampled_from([", ", "\n        - "]),
       fill=st.floats(0.1, 1.0))
def test_inputs_up_to_64_kib(pipeline_file: Path, item: str, separator: str, fill: float) -> None:
    head = VALID_HEAD + "      a: &a [lol]\n      many:" + ("\n        - " if separator != ", " else " [")
    room = int((MAX_INPUT_BYTES - len(head) - 2) * fill)
    count = max(1, room // (len(item) + len(separator)))
    tail = "]\n" if separator == ", " else "\n"
    check_text(pipeline_file, head + separator.join([item] * count) + tail, cli=False)
