"""Reading YAML: values YAML cannot read, merge keys, anchors, and the pure-Python parser."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from kvcompose import source
from kvcompose.config import load_pipeline
from kvcompose.errors import PipelineConfigError
from kvcompose.source import read_pipeline_source

HEAD = "version: 1\nname: x\nchildren:\n  - name: a\n    connector: ExampleConnector\n    config:\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(PipelineConfigError) as caught:
        load_pipeline(path)
    return [line.removeprefix(f"{path}:") for line in str(caught.value).splitlines()]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("2001-02-30", "'2001-02-30' is not a date or timestamp (YYYY-MM-DD, optionally with a time) "
                       "(day is out of range for month); quote it to keep it as text"),
        ("!!timestamp tomorrow", "'tomorrow' is not a date or timestamp (YYYY-MM-DD, optionally with a time)"),
        ("2001-02-03 25:00:00", "'2001-02-03 25:00:00' is not a date or timestamp (YYYY-MM-DD, optionally with a "
                                "time) (hour must be in 0..23); quote it to keep it as text"),
        ("!!int abc", "'abc' is not an integer"),
        ("!!float abc", "'abc' is not a number"),
        ("!!int ''", "'' is not an integer"),
        ("!!bool maybe", "'maybe' is not a boolean (true/false, yes/no, on/off)"),
        ("9" * 4301, "an integer of more than 4300 digits is not accepted; quote it to keep it as text"),
        ("!!binary aGk", "failed to decode base64 data: Incorrect padding"),
        ("!!str {a: 1}", "expected a scalar node, but found mapping"),
        ("!!omap [a]", "expected a mapping of length 1, but found scalar"),
        ("!!set [a]", "expected a mapping, found a sequence"),
        ("!!python/object:os.system x", "could not determine a constructor for the tag "
                                        "'tag:yaml.org,2002:python/object:os.system'"),
        ("!local x", "could not determine a constructor for the tag '!local'"),
    ],
)
def test_values_yaml_cannot_read_name_field_and_line(tmp_path: Path, value: str, message: str) -> None:
    path = write(tmp_path, HEAD + "      ok: 1\n      bad: " + value + "\n")
    assert problems(path) == [f"8: children[0].config.bad: {message}"]


def test_every_unreadable_value_is_reported_with_the_rest(tmp_path: Path) -> None:
    path = write(tmp_path, "version: !!int one\nname: x\nchildren:\n  - name: a\n    connector: ExampleConector\n"
                           "    config: {when: 2001-02-30, flag: !!bool maybe}\n    save: sometimes\n")
    assert problems(path) == [
        "1: version: 'one' is not an integer",
        "5: children[0].connector: unknown connector 'ExampleConector'; did you mean 'ExampleConnector'?",
        "6: children[0].config.when: '2001-02-30' is not a date or timestamp (YYYY-MM-DD, optionally with a time) "
        "(day is out of range for month); quote it to keep it as text",
        "6: children[0].config.flag: 'maybe' is not a boolean (true/false, yes/no, on/off)",
        "7: children[0].save: Input should be a valid boolean, unable to interpret input",
    ]


def test_readable_tagged_values_keep_their_types(tmp_path: Path) -> None:
    path = write(tmp_path, HEAD + "      when: 2001-02-03\n      at: 2001-02-03 04:05:06\n      blob: !!binary aGk=\n"
                                  "      text: '2001-02-03'\n      big: " + "9" * 4300 + "\n")
    config = load_pipeline(path).children[0].config
    assert config["when"] == datetime.date(2001, 2, 3)
    assert config["at"] == datetime.datetime(2001, 2, 3, 4, 5, 6)
    assert (config["blob"], config["text"], config["big"]) == (b"hi", "2001-02-03", int("9" * 4300))


def test_merge_keys(tmp_path: Path) -> None:
    path = write(tmp_path, """\
version: 1
name: x
children:
  - &hot
    name: hot
    connector: ExampleConnector
    save: false
    config: &paths {shared_storage_path: /tmp/hot, extra: 1}
  - <<: *hot
    name: cold
    config:
      <<: [{shared_storage_path: /tmp/cold}, *paths]
      more: 2
""")
    hot, cold = load_pipeline(path).children
    assert (cold.connector, cold.save, hot.name, cold.name) == ("ExampleConnector", False, "hot", "cold")
    # Own keys win over merged ones; among merged mappings, the earlier wins.
    assert cold.config == {"shared_storage_path": "/tmp/cold", "extra": 1, "more": 2}
    assert hot.config == {"shared_storage_path": "/tmp/hot", "extra": 1}


def test_merge_keys_keep_duplicate_refusal_and_lines(tmp_path: Path) -> None:
    path = write(tmp_path, """\
version: 1
name: x
children:
  - &base
    name: a
    connector: ExampleConnector
    save: often
  - <<: *base
    name: b
    name: c
    <<: *base
  - <<: [*base, 3]
    name: d
""")
    assert problems(path) == [
        # The merged value's problem is on the line it is written, under every child that merges it.
        "7: children[0].save: Input should be a valid boolean, unable to interpret input",
        "7: children[1].save: Input should be a valid boolean, unable to interpret input",
        "7: children[2].save: Input should be a valid boolean, unable to interpret input",
        "10: children[1].name: duplicate key 'name' (first at line 9)",
        "11: children[1].<<: duplicate key '<<' (first at line 8)",
        "12: children[2].<<: '<<' merges mappings: write '<<: *name' or '<<: [*name1, *name2]'",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: &x [1, *x]\n", "1: malformed YAML/JSON: the alias *x is used inside its own anchor &x"),
        ("a: *x\n", "1: malformed YAML/JSON: the alias *x has no anchor &x before it"),
        ("a: &x 1\nb: &x 2\n", "2: malformed YAML/JSON: the anchor &x is defined twice"),
        ("a: 1\n---\nb: 2\n", "2: malformed YAML/JSON: expected a single document in the file, found a second one (---)"),
        ("a: 1\nb: \x00\n", "2: malformed YAML/JSON: character #x0000 is not allowed in YAML"),
        ("? [1]\n: 2\n", "1: a list or mapping cannot be a key"),
    ],
)
def test_document_structure_errors(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    assert problems(path)[0] == message


DOCUMENTS = [
    HEAD + "      a: [1, 2.5, true, ~, 'q', \"d\"]\n      b:\n        - |\n          block\n        - >\n          folded\n",
    "base: &b {x: 1}\nuse: {<<: *b, y: 2}\nlist: &l [1, 2]\nagain: *l\n? complex\n: key\n=: value\n",
    "{\"version\": 1, \"name\": \"j\", \"children\": [{\"name\": \"a\", \"connector\": 3}]}\n",
    "a: 2001-02-30\nb: !!int x\nb: 1\n",
    "a: [1\n",
    "a: &x [*x]\n",
]


@pytest.mark.parametrize("text", DOCUMENTS)
def test_pure_python_parser_reads_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    # Where PyYAML has no libyaml, its own event parser is used: same data, lines and problems.
    path = write(tmp_path, text)

    def read() -> object:
        try:
            return read_pipeline_source(path)
        except PipelineConfigError as error:  # the parsers word syntax errors differently, on the same line
            return str(error).partition("malformed YAML/JSON:")[:2]

    with_libyaml = read()
    monkeypatch.setattr(source, "_EventParser", source._PurePythonEvents)
    assert read() == with_libyaml
