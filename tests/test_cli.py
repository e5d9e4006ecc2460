"""The kvcompose command line, run as users run it: a subprocess."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompose import __version__
from kvcompose.source import MAX_FILE_BYTES

from .test_config_limits import VALID_HEAD, alias_fan_out

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").rglob("*.yaml"))


def kvcompose(*args: str) -> subprocess.CompletedProcess[str]:
    # The timeout turns a hang (a FIFO read, an exponential walk) into a failure.
    return subprocess.run([sys.executable, "-m", "kvcompose", *args], capture_output=True, text=True, timeout=60)


def assert_refused(result: subprocess.CompletedProcess[str], path: Path | str, expected: list[str]) -> None:
    """Exit status 2, nothing on stdout, and one stderr line per problem, naming the file and field."""
    assert "Traceback" not in result.stderr
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == len(expected), lines
    for line, part in zip(lines, expected, strict=True):
        assert line.startswith(f"{path}") and part in line, (line, part)


def test_validate_ok() -> None:
    result = kvcompose("validate", str(REPO / "examples" / "pipeline.yaml"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: pipeline 'hot-then-cold', 2 children (hot, cold)")


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("version: 1\nname: x\nchildren:\n  - {name: a, connector: ExampleConector}\n", "children[0].connector"),
        ("version: 1\nname: x\nchildren: []\n", "children"),
        ("version: 1\nname: x\nchildren: [{name: a, connector: ExampleConnector, sav: 1}]\n", "children[0].sav"),
        ("version: [\n", "malformed YAML"),
    ],
)
def test_bad_pipeline_exits_2_with_one_line_naming_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    for command in ("validate", "render"):
        result = kvcompose(command, str(path))
        assert result.returncode == 2
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and field in lines[0] and str(path) in lines[0]
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [[], ["frobnicate"], ["validate"], ["render", "a", "b"], ["validate", "--bogus", "x"]])
def test_cli_misuse_exits_2_with_one_line(args: list[str]) -> None:
    result = kvcompose(*args)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("kvcompose") and " error: " in result.stderr


def test_missing_file_exits_2(tmp_path: Path) -> None:
    result = kvcompose("validate", str(tmp_path / "absent.yaml"))
    assert (result.returncode, result.stderr.strip()) == (2, f"{tmp_path / 'absent.yaml'}: file not found")


def test_render_is_accepted_by_vllm_kv_transfer_config() -> None:
    from vllm.config import KVTransferConfig

    for extra in ([], ["--inline"]):
        result = kvcompose("render", str(REPO / "examples" / "pipeline.yaml"), *extra)
        assert result.returncode == 0, result.stderr
        rendered = json.loads(result.stdout)
        config = KVTransferConfig(**rendered)
        assert config.kv_connector == "KVComposeConnector"
        assert config.kv_connector_module_path == "kvcompose.connectors"
        pipeline = config.kv_connector_extra_config["pipeline"]
        if extra:
            assert pipeline["children"][0]["name"] == "hot"
        else:
            assert pipeline == str((REPO / "examples" / "pipeline.yaml").resolve())


def test_schema_validates_every_example_pipeline() -> None:
    import jsonschema
    import yaml

    result = kvcompose("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert EXAMPLES, "no example pipelines found"
    for example in EXAMPLES:
        jsonschema.validate(yaml.safe_load(example.read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"version": 1, "name": "x", "children": [{"name": "a", "connector": "C", "typo": 1}]},
                            schema)
    enabled = {"version": 1, "name": "x", "children": [{"name": "a", "connector": "C"}]}
    jsonschema.validate({**enabled, "tracing": {"enabled": "${TRACING:-false}"}}, schema)  # resolved at load
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**enabled, "tracing": {"enabled": "yes please"}}, schema)


@pytest.mark.parametrize("command", ["validate", "render"])
def test_cli_does_not_import_vllm(command: str) -> None:
    code = ("import sys, runpy; sys.argv = ['kvcompose', %r, %r]\n"
            "try:\n    runpy.run_module('kvcompose', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')], 'vllm was imported'\n"
            "assert 'torch' not in sys.modules\n") % (command, str(REPO / "examples" / "offload" / "pipeline.yaml"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


BAD_PIPELINES = {
    "alias fan-out": (alias_fan_out(9), [": the document holds more than 20000 values, keys and list items"]),
    "deep nesting": (VALID_HEAD + "      v: " + "[" * 100_000 + "\n", [":7: the document nests deeper than 64 levels"]),
    "invalid date": (VALID_HEAD + "      v: 2001-02-30\n",
                     [":7: children[0].config.v: '2001-02-30' is not a date or timestamp"]),
    "!!int": (VALID_HEAD + "      v: !!int abc\n", [":7: children[0].config.v: 'abc' is not an integer"]),
    "!!float": (VALID_HEAD + "      v: !!float abc\n", [":7: children[0].config.v: 'abc' is not a number"]),
    "!!bool": (VALID_HEAD + "      v: !!bool maybe\n", [":7: children[0].config.v: 'maybe' is not a boolean"]),
    "!!timestamp": (VALID_HEAD + "      v: !!timestamp tomorrow\n",
                    [":7: children[0].config.v: 'tomorrow' is not a date or timestamp"]),
    "huge integer": (VALID_HEAD + "      v: " + "7" * 4301 + "\n",
                     [":7: children[0].config.v: an integer of more than 4300 digits is not accepted"]),
    "missing name hides nothing": (
        "version: 1\nchildren:\n  - {name: a, connector: ExampleConector}\n",
        [":1: name: required key is missing", ":3: children[0].connector: unknown connector 'ExampleConector'"]),
    "unset variable hides nothing": (
        "version: 1\nname: x\nchildren:\n  - {name: a, connector: ExampleConnector, load: '${KVC_TEST_UNSET}'}\n"
        "chidren: []\n",
        [":4: children[0].load: environment variable KVC_TEST_UNSET is not set",
         ":5: chidren: unknown key; did you mean 'children'?"]),
    "malformed references": (
        VALID_HEAD + "      a: ${\n      b: x${A\n      c: ${1X}\n",
        [":7: children[0].config.a: malformed reference '${'", ":8: children[0].config.b: malformed reference '${A'",
         ":9: children[0].config.c: malformed reference '${1X}'"]),
    "duplicate key beside a merge": (
        "version: 1\nname: x\nchildren:\n  - &a {name: a, connector: ExampleConnector}\n"
        "  - <<: *a\n    name: b\n    name: c\n",
        [":7: children[1].name: duplicate key 'name' (first at line 6)"]),
}


@pytest.mark.parametrize("case", sorted(BAD_PIPELINES))
def test_bad_pipelines_exit_2_with_one_line_per_problem(tmp_path: Path, case: str) -> None:
    text, expected = BAD_PIPELINES[case]
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert_refused(kvcompose("validate", str(path)), path, expected)


def test_files_that_are_no_pipeline_exit_2(tmp_path: Path) -> None:
    fifo = tmp_path / "pipeline.yaml"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    assert_refused(kvcompose("validate", str(fifo)), fifo, [": is a FIFO (named pipe), not a regular file"])
    assert_refused(kvcompose("render", "/dev/zero"), "/dev/zero", [": is a character device, not a regular file"])
    big = tmp_path / "big.yaml"
    big.write_text(VALID_HEAD + "      pad: '" + "x" * MAX_FILE_BYTES + "'\n")
    assert_refused(kvcompose("validate", str(big)), big, [": file is larger than 1 MiB"])


def test_render_inline_refuses_values_json_cannot_hold(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(VALID_HEAD + "      when: 2001-02-03\n      blob: !!binary aGk=\n      port: '${KVC_PORT:-1}'\n")
    assert kvcompose("validate", str(path)).returncode == 0
    assert kvcompose("render", str(path)).returncode == 0  # the engine reads the file itself
    assert_refused(kvcompose("render", "--inline", str(path)), path, [
        ":7: children[0].config.when: 2001-02-03 is a date or timestamp; JSON cannot hold it",
        ":8: children[0].config.blob: a bytes value (from a tag such as !!binary or !!set); JSON cannot hold it",
        ":9: children[0].config.port: '${KVC_PORT:-1}' is quoted, so it stays a string after substitution",
    ])


def test_render_inline_embeds_merged_and_nested_references_as_written(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nname: x\nchildren:\n  - &a\n    name: a\n    connector: ExampleConnector\n"
                    "    config:\n      path: ${KVC_TEST_UNSET:-${HOME}}/kv\n      flag: ${KVC_FLAG:-false}\n"
                    "  - {<<: *a, name: b}\n")
    result = kvcompose("render", "--inline", str(path))
    assert result.returncode == 0, result.stderr
    children = json.loads(result.stdout)["kv_connector_extra_config"]["pipeline"]["children"]
    assert children[1] == {"name": "b", "connector": "ExampleConnector",
                           "config": {"path": "${KVC_TEST_UNSET:-${HOME}}/kv", "flag": "${KVC_FLAG:-false}"}}


def test_version() -> None:
    result = kvcompose("--version")
    assert (result.returncode, result.stdout, result.stderr) == (0, f"kvcompose {__version__}\n", "")
    assert __version__ == importlib.metadata.version("kvcompose")  # the package and its metadata agree


def kvcompose_with_input(text: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcompose", *args], input=text, capture_output=True, text=True,
                          timeout=60)


def test_validate_and_render_read_standard_input() -> None:
    text = (REPO / "examples" / "pipeline.yaml").read_text()
    result = kvcompose_with_input(text, "validate", "-")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith("ok: pipeline 'hot-then-cold', 2 children (hot, cold)")
    rendered = kvcompose_with_input(text, "render", "-")  # no file for the engine to read: inline
    assert rendered.returncode == 0, rendered.stderr
    assert json.loads(rendered.stdout)["kv_connector_extra_config"]["pipeline"]["name"] == "hot-then-cold"
    refused = kvcompose_with_input(VALID_HEAD + "      v: !!int abc\n", "validate", "-")
    assert_refused(refused, "<stdin>", [":7: children[0].config.v: 'abc' is not an integer"])


def test_validate_counts_one_child_in_the_singular(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(VALID_HEAD + "      shared_storage_path: /tmp/kv\n")
    result = kvcompose("validate", str(path))
    assert result.stdout == "ok: pipeline 'x', 1 child (a), load policy first_match\n", result.stderr
