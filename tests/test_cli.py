"""The kvcompose command line, run as users run it: a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").rglob("*.yaml"))


def kvcompose(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcompose", *args], capture_output=True, text=True, timeout=60)


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


def test_cli_does_not_import_vllm() -> None:
    code = ("import sys, runpy; sys.argv = ['kvcompose', 'validate', %r]\n"
            "try:\n    runpy.run_module('kvcompose', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')], 'vllm was imported'\n"
            "assert 'torch' not in sys.modules\n") % str(REPO / "examples" / "pipeline.yaml")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
