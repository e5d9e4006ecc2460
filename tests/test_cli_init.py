"""`kvcompose init`: commented starter pipelines, from the package, that pass `validate` as written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompose.config import load_pipeline
from kvcompose.starters import STARTERS, starter_text

from .test_cli import kvcompose


def kvcompose_in(directory: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcompose", *args], capture_output=True, text=True, timeout=60,
                          cwd=directory, env={**os.environ, **env})


@pytest.mark.parametrize("kind", sorted(STARTERS))
def test_each_starter_is_written_and_passes_validate_and_render(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"{kind}.yaml"
    written = kvcompose("init", f"--{kind}", str(path))
    assert written.returncode == 0, written.stderr
    assert written.stdout.splitlines()[0] == f"wrote {path}: {STARTERS[kind]}"
    text = path.read_text()
    assert text == starter_text(kind).replace("THIS_FILE", str(path))
    assert f"kvcompose validate {path}" in text and "THIS_FILE" not in text
    validated = kvcompose("validate", str(path))
    assert (validated.returncode, validated.stderr) == (0, ""), validated.stderr
    rendered = kvcompose("render", str(path))
    assert json.loads(rendered.stdout)["kv_connector_extra_config"]["pipeline"] == str(path)


@pytest.mark.parametrize("kind", sorted(STARTERS))
def test_tracing_turns_on_with_an_environment_variable(tmp_path: Path, kind: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(starter_text(kind))
    monkeypatch.delenv("KVCOMPOSE_TRACING", raising=False)
    assert load_pipeline(path).tracing.enabled is False
    monkeypatch.setenv("KVCOMPOSE_TRACING", "true")
    assert load_pipeline(path).tracing.enabled is True


def test_the_offload_starter_uses_kvcompose_cpu_spec_in_front_of_a_disk_tier(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(starter_text("offload"))
    offload, disk = load_pipeline(path).children
    assert (offload.connector, offload.config["spec_name"], offload.config["spec_module_path"]) == (
        "OffloadingConnector", "CPUEngineOffloadingSpec", "kvcompose.offload.spec")
    assert disk.connector == "ExampleConnector"


def test_init_writes_the_offload_starter_to_pipeline_yaml_by_default(tmp_path: Path) -> None:
    result = kvcompose_in(tmp_path, "init")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "pipeline.yaml").read_text() == starter_text("offload").replace("THIS_FILE", "pipeline.yaml")


def test_init_refuses_to_overwrite_unless_forced(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text("mine\n")
    refused = kvcompose("init", "--disk", str(path))
    assert (refused.returncode, refused.stdout, refused.stderr) == (
        2, "", f"{path}: exists; pass --force to overwrite it\n")
    assert path.read_text() == "mine\n"
    forced = kvcompose("init", "--disk", "--force", str(path))
    assert forced.returncode == 0, forced.stderr
    assert path.read_text() == starter_text("disk").replace("THIS_FILE", str(path))


def test_init_refuses_a_directory_and_one_starter_at_a_time(tmp_path: Path) -> None:
    directory = kvcompose("init", str(tmp_path))
    assert (directory.returncode, directory.stderr) == (
        2, f"{tmp_path}: is a directory; name the file to write, e.g. {tmp_path / 'pipeline.yaml'}\n")
    both = kvcompose("init", "--disk", "--pd", str(tmp_path / "p.yaml"))
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    assert list(tmp_path.iterdir()) == []


def test_init_dash_prints_the_starter(tmp_path: Path) -> None:
    result = kvcompose_in(tmp_path, "init", "--pd", "-")
    assert (result.returncode, result.stdout) == (0, starter_text("pd"))
    assert list(tmp_path.iterdir()) == []
