"""`kvcompose validate` beyond the schema: vLLM connectors' settings and the modules children name."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from kvcompose.checks import child_problems
from kvcompose.config import load_pipeline
from kvcompose.connector_settings import (
    CPU_SPEC,
    KVCOMPOSE_SPEC,
    KVCOMPOSE_SPEC_MODULE,
    KVCOMPOSE_SPEC_NAME,
    NIXL,
    OFFLOADING_CONNECTOR,
)

from .test_cli import assert_refused, kvcompose

OFFLOAD = {"name": "offload", "connector": "OffloadingConnector",
           "config": {"spec_name": KVCOMPOSE_SPEC_NAME, "spec_module_path": KVCOMPOSE_SPEC_MODULE,
                      "cpu_bytes_to_use": 1 << 30}}
NIXL_CHILD = {"name": "nixl", "connector": "NixlConnector", "config": {}}
VLLM_SOURCE = Path(importlib.util.find_spec("vllm").origin).parent  # type: ignore[union-attr, arg-type]


def write_pipeline(tmp_path: Path, *children: dict) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "name": "x", "children": list(children)}, sort_keys=False))
    return path


def with_config(child: dict, **config: object) -> dict:
    return {**child, "config": {**child["config"], **config}}


@pytest.mark.parametrize(("child", "key", "message"), [
    (with_config(OFFLOAD, cpu_bytes_to_use="abc"), "cpu_bytes_to_use",
     "'abc' is not a positive integer: CPUEngineOffloadingSpec reads it with int()"),
    (with_config(OFFLOAD, cpu_bytes_to_use=0), "cpu_bytes_to_use", "0 is not a positive integer"),
    (with_config(OFFLOAD, canonical_layout="false"), "canonical_layout",
     "'false' is not true or false, unquoted: OffloadingConnector reads any non-empty string, 'false' too, as true"),
    (with_config(OFFLOAD, block_size=1.5), "block_size", "1.5 is not a positive integer"),
    (with_config(OFFLOAD, block_size=256, blocks_per_chunk=2), "blocks_per_chunk",
     "set block_size or blocks_per_chunk, not both"),
    (with_config(OFFLOAD, eviction_policy="lfu"), "eviction_policy",
     "'lfu' is not one of lru, arc; set cache_policy_module_path"),
    (with_config(OFFLOAD, host_buffer_dir=["/a"]), "host_buffer_dir", "['/a'] is not a string"),
    ({"name": "offload", "connector": "OffloadingConnector", "config": {"cpu_bytes_to_use": "1e9"}},
     "cpu_bytes_to_use", "'1e9' is not a positive integer: CPUOffloadingSpec reads it with int()"),
    ({"name": "offload", "connector": "OffloadingConnector", "config": {"spec_name": "MySpec"}},
     "spec_name", "'MySpec' is not one of vLLM's offloading specs"),
    (with_config(NIXL_CHILD, backends="UCX"), "backends", "'UCX' is not a list of strings"),
    (with_config(NIXL_CHILD, kv_lease_duration="30"), "kv_lease_duration",
     "'30' is not a number: NixlConnector computes with it as it is"),
    (with_config(NIXL_CHILD, enforce_handshake_compat="no"), "enforce_handshake_compat", "'no' is not true or false"),
])
def test_a_known_key_of_the_wrong_type_is_an_error_naming_it(tmp_path: Path, child: dict, key: str,
                                                            message: str) -> None:
    path = write_pipeline(tmp_path, child)
    for command in ("validate", "render"):
        assert_refused(kvcompose(command, str(path)), path, [f"children[0].config.{key}: {message}"])


def test_cpu_bytes_to_use_is_required_by_the_cpu_specs(tmp_path: Path) -> None:
    child = {"name": "offload", "connector": "OffloadingConnector", "config": {}}
    path = write_pipeline(tmp_path, child)
    assert_refused(kvcompose("validate", str(path)), path,
                   ["children[0].config: cpu_bytes_to_use is required by CPUOffloadingSpec"])


def test_values_vllm_reads_pass(tmp_path: Path) -> None:
    """What vLLM's own int()/float() accept passes: a quoted number, an integral float, an environment default."""
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nname: x\nchildren:\n"
                    "  - name: offload\n    connector: OffloadingConnector\n    config:\n"
                    f"      spec_name: {KVCOMPOSE_SPEC_NAME}\n      spec_module_path: {KVCOMPOSE_SPEC_MODULE}\n"
                    "      cpu_bytes_to_use: ${KVC_TEST_UNSET_BYTES:-1073741824}\n      block_size: '256'\n"
                    "      host_buffer_dir: ${KVC_TEST_UNSET_DIR:-}\n      eviction_policy: arc\n"
                    "      some_future_key: anything\n"
                    "  - name: nixl\n    connector: NixlConnector\n    config:\n"
                    "      backends: [UCX]\n      kv_lease_duration: 30\n      push_registration_timeout: '2.5'\n")
    result = kvcompose("validate", str(path))
    assert (result.returncode, result.stderr) == (0, "")


def test_a_close_misspelling_of_a_known_key_is_a_warning(tmp_path: Path) -> None:
    child = with_config(OFFLOAD, cpu_byte_to_use=1)
    path = write_pipeline(tmp_path, child)
    result = kvcompose("validate", str(path))
    assert result.returncode == 0 and result.stdout.startswith("ok: "), result.stderr
    assert result.stderr.splitlines() == [
        f"{path}:10: children[0].config.cpu_byte_to_use: warning: OffloadingConnector reads no 'cpu_byte_to_use'; "
        "did you mean 'cpu_bytes_to_use'?"]


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package of connector modules on the path of the CLI (a subprocess started in ``tmp_path``)."""
    package = tmp_path / "mine"
    (package / "sub").mkdir(parents=True)
    # The package runs code that must not run at validation (as importing vLLM would).
    (package / "__init__.py").write_text("raise RuntimeError('the package was run')\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "good.py").write_text(
        "import os\nif os.environ.get('X'):\n    from elsewhere import Defined as Imported\n"
        "try:\n    pass\nexcept ImportError:\n    Assigned = None\nclass MyConnector:\n    pass\n")
    (package / "sub" / "star.py").write_text("from elsewhere import *\n")
    (package / "sub" / "broken.py").write_text("class MyConnector(:\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("module", "connector", "problem"), [
    ("mine.sub.good", "MyConnector", None),
    ("mine.sub.good", "Imported", None),
    ("mine.sub.good", "Assigned", None),
    ("mine.sub.star", "Anything", None),  # only running it would tell
    ("mine.sub.good", "MyConector", r"module 'mine.sub.good' \(.*good.py\) defines no 'MyConector'"),
    ("mine.sub.absent", "MyConnector", r"no module 'mine.sub.absent' in this Python environment$"),
    ("mine.sub.broken", "MyConnector", r"module 'mine.sub.broken' cannot be imported: .* \(.*broken.py, line 1\)"),
    ("mine..sub", "MyConnector", r"'mine..sub' is not a Python module name"),
])
def test_a_module_path_that_does_not_import_is_an_error(modules: Path, module: str, connector: str,
                                                         problem: str | None) -> None:
    path = write_pipeline(modules, {"name": "mine", "connector": connector, "module_path": module})
    result = kvcompose("validate", str(path))
    if problem is None:
        assert (result.returncode, result.stderr) == (0, "")
        return
    assert_refused(result, path, ["children[0].module_path: "])
    assert re.search(problem, result.stderr.strip()), result.stderr


def test_offloading_spec_and_cache_policy_modules_are_checked_too(modules: Path) -> None:
    child = with_config(OFFLOAD, spec_name="MySpec", spec_module_path="mine.sub.good", eviction_policy="MyPolicy",
                        cache_policy_module_path="mine.sub.nope")
    path = write_pipeline(modules, child)
    assert_refused(kvcompose("validate", str(path)), path, [
        "children[0].config.spec_module_path: module 'mine.sub.good'",
        "children[0].config.cache_policy_module_path: no module 'mine.sub.nope'"])


def test_a_module_not_found_is_a_warning_where_vllm_is_not_installed() -> None:
    pipeline = load_pipeline({"version": 1, "name": "x", "children": [
        {"name": "absent", "connector": "C", "module_path": "kvc_test_absent.connector"},
        {"name": "nameless", "connector": "Nope", "module_path": "kvcompose.render"}]})
    absent, nameless = child_problems(pipeline, vllm_here=False)
    assert absent.warning and "may not be the engine's environment" in absent.message
    assert not nameless.warning  # the module is here, and lacks the class: wherever vLLM is
    assert [problem.warning for problem in child_problems(pipeline, vllm_here=True)] == [False, False]


@pytest.mark.parametrize(("reader", "sources"), [
    (OFFLOADING_CONNECTOR, ["distributed/kv_transfer/kv_connector/v1/offloading/config.py",
                            "v1/kv_offload/base.py", "v1/kv_offload/factory.py"]),
    (CPU_SPEC, ["v1/kv_offload/cpu/spec.py"]),
    (NIXL, ["distributed/kv_transfer/kv_connector/v1/nixl"]),
])
def test_every_known_key_is_read_by_the_installed_vllm(reader: object, sources: list[str]) -> None:
    text = "".join(path.read_text() for source in sources for path in
                   ([VLLM_SOURCE / source] if source.endswith(".py") else sorted((VLLM_SOURCE / source).glob("*.py"))))
    assert [key for key in reader.keys if f'"{key}"' not in text] == []  # type: ignore[attr-defined]


def test_kvcompose_spec_names_match_its_module() -> None:
    from kvcompose.offload import spec

    assert (spec.CPUEngineOffloadingSpec.__module__, spec.CPUEngineOffloadingSpec.__name__) == (
        KVCOMPOSE_SPEC_MODULE, KVCOMPOSE_SPEC_NAME)
    assert spec.HOST_BUFFER_DIR_KEY in KVCOMPOSE_SPEC.keys
