"""kvcompose against the connector API of every vLLM release it supports.

``tests/vllm_api/<version>.json`` is one release's ``KVConnectorBase_V1``,
``SupportsHMA`` and ``MultiConnector``, read from its wheel (0.33 has no CPU
build; it is checked here without running). A new release is one more file
(``python -m tests.vllm_api WHEEL``); what it adds fails here by name until
kvcompose implements it, and the installed vLLM must match its own file.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvcompose.operations import CONNECTOR_OPERATIONS, HMA_OPERATIONS
from kvcompose.vllm_names import BUILTIN_CONNECTORS, KV_TRANSFER_FIELDS

from .vllm_api import (
    UNUSED_KV_TRANSFER_FIELDS,
    checked_in,
    checked_in_versions,
    class_members,
    extract,
    installed_source,
)

VERSIONS = checked_in_versions()
ROOT = Path(__file__).resolve().parents[1]

# Base-class members a kvcompose connector inherits on purpose.
INHERITED = {
    "__init__": "both call the base's __init__ and keep its state",
    "role": "the base's property over that state",
    "has_connector_metadata": "reads the connector's own bound metadata",
}
INHERITED_BY_COMPOSITE = {
    **INHERITED,
    "get_kv_connector_kv_cache_events": "not aggregated, like MultiConnector: children's events reach vLLM "
    "through take_events",
}
# Functions of vLLM that walk MultiConnector's private child list, and what kvcompose does instead.
CHILD_LIST_READERS = {
    "vllm/distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py:_find_simple_cpu_offload_connector":
    "the SimpleCPUOffloadConnector worker's block count; kvcompose requires num_cpu_blocks (kvcompose.compat)",
}
# MultiConnector members the composite has no use for.
MULTICONNECTOR_ONLY = {
    "sub_connectors": "MultiConnector's list of children; vLLM does not read it",
    "all_children_support_hma": "vLLM's factory asks MultiConnector by name; kvcompose names KVComposeHMAConnector",
}


def _kvcompose_members(module: str, class_name: str) -> dict[str, str]:
    """kvcompose's class as the release sets describe vLLM's: what its body defines, read from its source."""
    return class_members(ast.parse((ROOT / module).read_text()), class_name)


COMPOSITE = _kvcompose_members("kvcompose/connectors/composite.py", "KVComposeConnector")
FAULT_INJECTION = _kvcompose_members("kvcompose/connectors/fault_injection.py", "FaultInjectionConnector")
CONNECTORS = {"KVComposeConnector": (COMPOSITE, INHERITED_BY_COMPOSITE),
              "FaultInjectionConnector": (FAULT_INJECTION, INHERITED)}


def _public(members: dict[str, str]) -> dict[str, str]:
    return {name: kind for name, kind in members.items() if not name.startswith("_") or name == "__init__"}


def _comparable(kind: str) -> str:
    return kind.removeprefix("abstract")  # kvcompose implements what the base leaves abstract


def test_every_supported_release_has_a_checked_in_set() -> None:
    """The releases pyproject.toml promises users, each with its API set here."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (spec,) = [r for r in project["optional-dependencies"]["vllm"] if r.startswith("vllm")]
    low, high = (int(minor) for minor in re.fullmatch(r"vllm>=0\.(\d+),<0\.(\d+)", spec).groups())
    assert [v.rsplit(".", 1)[0] for v in VERSIONS] == [f"0.{minor}" for minor in range(low, high)]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("connector", sorted(CONNECTORS))
def test_every_base_member_is_implemented(connector: str, version: str) -> None:
    members, inherited = CONNECTORS[connector]
    base = _public(checked_in(version)["classes"]["KVConnectorBase_V1"])
    missing = sorted(base.keys() - members.keys() - inherited.keys())
    assert not missing, f"vLLM {version}'s KVConnectorBase_V1 has members {connector} does not implement: {missing}"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("connector", sorted(CONNECTORS))
def test_signatures_match_the_base(connector: str, version: str) -> None:
    """Same kind and parameters as the base in every release (a forwarded attribute takes whatever it is given)."""
    members, _ = CONNECTORS[connector]
    classes = checked_in(version)["classes"]
    base = {**_public(classes["KVConnectorBase_V1"]), **_public(classes["SupportsHMA"])}
    differ = {
        name: (base[name], members[name]) for name in sorted(base.keys() & members.keys())
        if members[name] != "attribute" and _comparable(base[name]) != members[name] and name != "__init__"
    }
    assert not differ, f"{connector} differs from vLLM {version}'s base (vLLM's, kvcompose's): {differ}"


@pytest.mark.parametrize("version", VERSIONS)
def test_what_multiconnector_forwards_the_composite_forwards(version: str) -> None:
    overridden = _public(checked_in(version)["classes"]["MultiConnector"])
    missing = sorted(overridden.keys() - COMPOSITE.keys() - MULTICONNECTOR_ONLY.keys())
    assert not missing, f"vLLM {version}'s MultiConnector defines {missing}; KVComposeConnector does not"


def test_connector_operations_are_every_release_s_instance_methods() -> None:
    """kvcompose.operations names each instance method of any supported release, and nothing else."""
    methods: set[str] = set()
    for version in VERSIONS:
        classes = checked_in(version)["classes"]
        for cls in ("KVConnectorBase_V1", "SupportsHMA"):
            methods |= {name for name, kind in _public(classes[cls]).items()
                        if re.match(r"(abstract)?method\(self", kind) and name != "__init__"}
    assert methods - INHERITED.keys() == set(CONNECTOR_OPERATIONS)
    assert HMA_OPERATIONS == set(_public(checked_in(VERSIONS[-1])["classes"]["SupportsHMA"]))


@pytest.mark.parametrize("version", VERSIONS)
def test_kvcompose_names_match_every_release(version: str) -> None:
    """The vLLM names kvcompose keeps for its CLI (0.30/0.31 have four more, unused transfer fields)."""
    api = checked_in(version)
    assert set(api["kv_transfer_config_fields"]) - UNUSED_KV_TRANSFER_FIELDS == set(KV_TRANSFER_FIELDS)
    assert set(api["registered_connectors"]) == set(BUILTIN_CONNECTORS)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_name_lookup_is_handled(version: str) -> None:
    """Each connector vLLM finds by name is refused or warned about when it is a kvcompose child."""
    from kvcompose.compat import NAME_LOOKUPS, SIMPLE_CPU_OFFLOAD

    unhandled = sorted(set(checked_in(version)["name_lookups"]) - NAME_LOOKUPS.keys() - {SIMPLE_CPU_OFFLOAD})
    assert not unhandled, f"vLLM {version} finds {unhandled} by name; say in kvcompose.compat what that means"


@pytest.mark.parametrize("version", VERSIONS)
def test_every_reader_of_multiconnector_s_child_list_is_known(version: str) -> None:
    unknown = sorted(set(checked_in(version)["child_list_readers"]) - CHILD_LIST_READERS.keys())
    assert not unknown, f"vLLM {version} looks inside MultiConnector in {unknown}; kvcompose children are not there"


def test_installed_vllm_matches_its_checked_in_set() -> None:
    installed = extract(installed_source())
    version = installed["vllm"]
    assert version in VERSIONS, (
        f"no API set for the installed vLLM {version}: pip download --no-deps vllm=={version} -d DIR, "
        "then python -m tests.vllm_api DIR/*.whl"
    )
    expected = checked_in(version)
    differ = {key: _difference(expected[key], installed[key]) for key in expected if expected[key] != installed[key]}
    assert not differ, f"the installed vLLM {version} differs from tests/vllm_api/{version}.json: {differ}"


def test_feature_detection_agrees_with_the_installed_set() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvcompose.compat import SIMPLE_CPU_OFFLOAD, SIZED_BY_NAME

    api = checked_in(extract(installed_source())["vllm"])
    assert SIZED_BY_NAME == (SIMPLE_CPU_OFFLOAD in api["name_lookups"])
    base = api["classes"]["KVConnectorBase_V1"]
    assert {name for name in base if hasattr(KVConnectorBase_V1, name)} == set(base)


def _difference(expected: Any, installed: Any) -> Any:
    """Only what differs: per key of a mapping, missing and new items of a list."""
    if isinstance(expected, dict) and isinstance(installed, dict):
        return {key: _difference(expected.get(key), installed.get(key))
                for key in sorted(expected.keys() | installed.keys()) if expected.get(key) != installed.get(key)}
    if isinstance(expected, list) and isinstance(installed, list):
        return {"missing": sorted(set(expected) - set(installed)), "new": sorted(set(installed) - set(expected))}
    return expected, installed
