"""``${VAR}`` references: nesting, malformed references, and the types of substituted values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcompose.config import load_pipeline
from kvcompose.errors import PipelineConfigError
from kvcompose.interpolation import interpolate_env

HEAD = "version: 1\nname: x\nchildren:\n  - name: a\n    connector: ExampleConnector\n    config:\n"
ENV = {"HOME_DIR": "/home/k", "EMPTY": "", "FLAG": "false", "PORT": "8080"}


def file_problems(tmp_path: Path, text: str) -> tuple[Path, list[str]]:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    with pytest.raises(PipelineConfigError) as caught:
        load_pipeline(path)
    return path, str(caught.value).splitlines()


def resolve(value: str, env: dict[str, str] | None = None) -> tuple[Any, list[str]]:
    result, found = interpolate_env({"v": value}, ENV if env is None else env)
    return result["v"], [problem.describe() for problem in found]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("${HOME_DIR}/kv", "/home/k/kv"),
        ("${UNSET:-${HOME_DIR}}", "/home/k"),
        ("${UNSET:-${ALSO_UNSET:-${HOME_DIR}/x}}/y", "/home/k/x/y"),
        ("${UNSET:-a}${UNSET:-b}", "ab"),
        ("${HOME_DIR:-${UNSET}}", "/home/k"),  # an unused default may name unset variables
        ("${EMPTY:-fallback}", ""),  # set but empty is still set
        ("${UNSET:-}", ""),
        ("${UNSET:-a:-b}", "a:-b"),
        ("$${HOME_DIR}", "${HOME_DIR}"),
        ("${UNSET:-$${x}", "${x"),  # $${ inside a default is a literal ${, and the first } closes the default
        ("cost: $5, {braces} and }", "cost: $5, {braces} and }"),
        ("$$", "$$"),
    ],
)
def test_references_resolve(text: str, expected: str) -> None:
    assert resolve(text) == (expected, [])


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("${", "'${' at character 1: a variable name (letters, digits and _, not starting with a digit) must follow ${"),
        ("x ${A", "'${A' at character 3: no closing }"),
        ("${1X}", "'${1X}' at character 1: a variable name (letters, digits and _, not starting with a digit) "
                  "must follow ${"),
        ("${}", "'${}' at character 1: a variable name (letters, digits and _, not starting with a digit) "
                "must follow ${"),
        ("${A-default}", "'${A-default}' at character 1: expected } or :-default} after ${A"),
        ("${A:?error}", "'${A:?error}' at character 1: expected } or :-default} after ${A"),
        ("${A:-x", "'${A:-x' at character 1: no closing }"),
        ("${A:-${B}", "'${A:-${B}' at character 1: no closing }"),
        ("${A:-${ B}}", "'${ B}}' at character 6: a variable name (letters, digits and _, not starting with a digit) "
                        "must follow ${"),
        ("${A:-" * 9 + "x" + "}" * 9, "'${A:-x}}}}}}}}}' at character 41: defaults nest more than 8 references deep"),
    ],
)
def test_malformed_references_are_errors(text: str, reason: str) -> None:
    value, found = resolve(text)
    assert value == text  # kept as written, so later checks do not add noise about it
    assert found == [f"v: malformed reference {reason} (write ${{NAME}} or ${{NAME:-default}}; $${{ writes a literal ${{)"]


def test_malformed_references_name_field_and_line(tmp_path: Path) -> None:
    path, found = file_problems(
        tmp_path, HEAD + "      ok: ${UNSET:-fine}\n      bad: prefix-${1X}\n    transfer:\n      engine_id: ${\n")
    assert found == [
        f"{path}:8: children[0].config.bad: malformed reference '${{1X}}' at character 8: a variable name (letters, "
        "digits and _, not starting with a digit) must follow ${ (write ${NAME} or ${NAME:-default}; $${ writes a "
        "literal ${)",
        f"{path}:10: children[0].transfer.engine_id: malformed reference '${{' at character 1: a variable name "
        "(letters, digits and _, not starting with a digit) must follow ${ (write ${NAME} or ${NAME:-default}; $${ "
        "writes a literal ${)",
    ]


def test_each_unset_variable_is_reported_once_per_field() -> None:
    value, found = resolve("${A}/${B:-${A}}/${A}", {})
    assert value == "${A}/${B:-${A}}/${A}"
    assert found == ["v: environment variable A is not set (use ${A:-default})"]


def test_whole_references_in_child_config_are_read_as_yaml_scalars(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NAME", "123")
    monkeypatch.delenv("UNSET", raising=False)
    path = tmp_path / "pipeline.yaml"
    path.write_text("""\
version: 1
name: ${NAME}
children:
  - name: a
    connector: ExampleConnector
    save: ${FLAG}
    config:
      flag: ${FLAG:-true}
      port: ${PORT}
      ratio: ${UNSET:-1.5}
      nothing: ${UNSET:-null}
      empty: ${UNSET:-}
      yes_word: ${UNSET:-yes}
      listed:
        - ${PORT}
      quoted: "${FLAG}"
      single_quoted: '${PORT}'
      block: |
        ${PORT}
      joined: ${PORT}${UNSET:-}
      word: ${HOME_DIR}
      date_stays_text: ${UNSET:-2001-02-03}
    transfer:
      kv_port: ${PORT}
""")
    pipeline = load_pipeline(path)
    child = pipeline.children[0]
    # Typed fields convert from the text themselves: a label-safe name made of digits stays a string.
    assert (pipeline.name, child.save) == ("123", False)
    assert child.config == {
        "flag": False, "port": 8080, "ratio": 1.5, "nothing": None, "empty": None, "yes_word": True,
        "listed": [8080], "quoted": "false", "single_quoted": "8080", "block": "8080\n", "joined": "8080",
        "word": "/home/k", "date_stays_text": "2001-02-03",
    }
    assert child.transfer == {"kv_port": 8080}


def test_mappings_have_no_quotes_so_every_whole_reference_is_read_as_a_scalar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLAG", "false")
    child = {"name": "a", "connector": "ExampleConnector", "config": {"flag": "${FLAG}", "text": "x${FLAG}"}}
    config = load_pipeline({"version": 1, "name": "x", "children": [child]}).children[0].config
    assert config == {"flag": False, "text": "xfalse"}


def test_a_substituted_value_yaml_cannot_read_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HUGE", "9" * 5000)
    path, found = file_problems(tmp_path, HEAD + "      big: ${HUGE}\n      fine: '${HUGE}'\n")
    assert found == [
        f"{path}:7: children[0].config.big: the value of ${{HUGE}} cannot be read: an integer of more than 4300 "
        "digits is not accepted; quote it to keep it as text"]
