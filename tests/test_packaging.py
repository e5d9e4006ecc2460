"""Building and installing from the checkout: what the wheel and sdist hold, no warnings, no litter in the tree."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STARTERS = {f"kvcompose/starters/{kind}.yaml" for kind in ("offload", "disk", "pd")}


def build_litter() -> set[Path]:
    """What setuptools builds left in a checkout: build/ and *.egg-info."""
    return {*REPO.glob("build"), *REPO.glob("*.egg-info"), *REPO.glob("kvcompose/*.egg-info")}


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    # No build isolation: the venv has hatchling, and nothing is downloaded.
    return subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "--quiet"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


def build(target: str, directory: Path) -> Path:
    """Build ``target`` (wheel, sdist) with the project's backend, which must say nothing but what it built."""
    litter = build_litter()
    result = subprocess.run([sys.executable, "-m", "hatchling", "build", "-t", target, "-d", str(directory)],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    (built,) = directory.iterdir()
    assert (result.returncode, result.stdout, result.stderr) == (0, "", f"{built}\n")  # no warning
    assert build_litter() == litter
    return built


def test_the_wheel_holds_the_starters_and_entry_points(tmp_path: Path) -> None:
    with zipfile.ZipFile(build("wheel", tmp_path)) as archive:
        names = set(archive.namelist())
        entry_points = configparser.ConfigParser()
        entry_points.read_string(archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt")))
                                 .decode())
    assert STARTERS <= names
    assert not [name for name in names if name.startswith(("tests/", "examples/", "benchmarks/"))]
    assert dict(entry_points["console_scripts"]) == {"kvcompose": "kvcompose.cli:main"}
    assert dict(entry_points["vllm.general_plugins"]) == {"kvcompose": "kvcompose.plugin:register"}


def test_the_sdist_holds_the_examples_and_docs(tmp_path: Path) -> None:
    with tarfile.open(build("sdist", tmp_path)) as archive:
        names = {name.partition("/")[2] for name in archive.getnames()}
    assert {"examples/pipeline.yaml", "examples/offload/pipeline.yaml", "README.md", "pyproject.toml"} <= names
    assert STARTERS <= names and any(name.startswith("docs/") for name in names)


def test_an_install_from_the_checkout_writes_starters_from_its_own_copy(tmp_path: Path) -> None:
    target = tmp_path / "site"
    installed = pip("install", "--target", str(target), str(REPO))
    assert installed.returncode == 0, installed.stderr
    # The install's copy comes first on the path, before the checkout the venv's .pth names.
    result = subprocess.run([sys.executable, "-m", "kvcompose", "init", "--disk", "-"], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(target)})
    assert result.returncode == 0, result.stderr
    assert result.stdout == (target / "kvcompose" / "starters" / "disk.yaml").read_text()
    where = subprocess.run([sys.executable, "-c", "import kvcompose.starters as s; print(s.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(target)})
    assert Path(where.stdout.strip()).is_relative_to(target), where.stdout
