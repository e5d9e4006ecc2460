"""The settings of vLLM's connectors that kvcompose knows, checked as vLLM will read them.

A child's ``config`` reaches the connector as its ``kv_connector_extra_config``,
untyped: a wrong value passes the pipeline's schema and fails only when the
engine starts, or never (the string "false" is true). For the connectors
below, each key kvcompose knows is checked against the way vLLM reads it,
from vLLM 0.32's source:

- ``OffloadingConnector``: ``kv_connector/v1/offloading/config.py``
  (``block_size``, ``blocks_per_chunk``, ``canonical_layout``),
  ``v1/kv_offload/base.py`` (``offload_prompt_only``, ``self_describing_kv_events``)
  and ``v1/kv_offload/factory.py`` (``spec_name``, ``spec_module_path``);
- its CPU spec, ``v1/kv_offload/cpu/spec.py`` (``cpu_bytes_to_use``, required;
  ``eviction_policy``, ``cache_policy_module_path``, ``store_threshold``,
  ``max_tracker_size``), and kvcompose's CPU-engine spec (``host_buffer_dir``);
- ``NixlConnector`` and its pull/push variants: ``kv_connector/v1/nixl/``.

Keys it does not know pass: other vLLM versions and specs read others. A
close misspelling of a known key is a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcompose.config import ChildConfig, did_you_mean
from kvcompose.errors import FieldPath, Problem, shown

# kvcompose's spec for CPU engines (kvcompose/offload/spec.py; importing it imports vLLM).
KVCOMPOSE_SPEC_NAME = "CPUEngineOffloadingSpec"
KVCOMPOSE_SPEC_MODULE = "kvcompose.offload.spec"
# Specs vLLM's OffloadingSpecFactory registers: spec_module_path is not read for these.
BUILTIN_SPECS = frozenset({"CPUOffloadingSpec", "TieringOffloadingSpec"})
BUILTIN_EVICTION_POLICIES = ("lru", "arc")
NIXL_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector"})


@dataclass(frozen=True)
class Expected:
    """What a key's value must be: ``description`` and how its reader ``reads`` it, for the message;
    ``accepts`` to test it."""

    description: str
    reads: str
    accepts: Callable[[Any], bool]


def _integer_value(value: Any) -> int | None:
    """The integer vLLM's ``int(value)`` gives without losing anything, or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, (int, str)):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _positive_integer(value: Any) -> bool:
    number = _integer_value(value)
    return number is not None and number > 0


def _float_text(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bool)


INTEGER = Expected("an integer", "reads it with int()", lambda value: _integer_value(value) is not None)
POSITIVE_INTEGER = Expected("a positive integer", "reads it with int()", _positive_integer)
NUMBER = Expected("a number", "computes with it as it is",
                  lambda value: isinstance(value, (int, float)) and not isinstance(value, bool))
NUMBER_OR_TEXT = Expected("a number", "reads it with float()", _float_text)
BOOLEAN = Expected("true or false, unquoted", "reads any non-empty string, 'false' too, as true",
                   lambda value: isinstance(value, bool))
TEXT = Expected("a string", "reads it as a name", lambda value: isinstance(value, str))
TEXT_LIST = Expected("a list of strings", "reads it as a list of names",
                     lambda value: isinstance(value, list) and all(isinstance(item, str) for item in value))


@dataclass(frozen=True)
class Reader:
    """A connector or offloading spec, and the keys of the child's config it reads."""

    name: str
    keys: Mapping[str, Expected]
    required: tuple[str, ...] = field(default=())


OFFLOADING_CONNECTOR = Reader("OffloadingConnector", {
    "spec_name": TEXT,
    "spec_module_path": TEXT,
    "block_size": POSITIVE_INTEGER,
    "blocks_per_chunk": POSITIVE_INTEGER,
    "canonical_layout": BOOLEAN,
    "offload_prompt_only": BOOLEAN,
    "self_describing_kv_events": BOOLEAN,
})
_CPU_SPEC_KEYS = {
    "cpu_bytes_to_use": POSITIVE_INTEGER,
    "eviction_policy": TEXT,
    "cache_policy_module_path": TEXT,
    "store_threshold": INTEGER,
    "max_tracker_size": INTEGER,
}
CPU_SPEC = Reader("CPUOffloadingSpec", _CPU_SPEC_KEYS, required=("cpu_bytes_to_use",))
KVCOMPOSE_SPEC = Reader(KVCOMPOSE_SPEC_NAME, {**_CPU_SPEC_KEYS, "host_buffer_dir": TEXT},
                        required=("cpu_bytes_to_use",))
NIXL = Reader("NixlConnector", {
    "backends": TEXT_LIST,
    "num_threads": INTEGER,
    "kv_lease_duration": NUMBER,
    "engine_ttl": NUMBER,
    "decoder_kv_blocks_ttl": NUMBER,
    "push_registration_timeout": NUMBER_OR_TEXT,
    "kv_recompute_threshold": INTEGER,
    "bidirectional_kv_xfer": BOOLEAN,
    "enforce_handshake_compat": BOOLEAN,
})

# A key one of these reads is no misspelling, even where kvcompose cannot tell its reader (an out-of-tree spec).
_EVERY_KEY = frozenset(key for reader in (OFFLOADING_CONNECTOR, KVCOMPOSE_SPEC, NIXL) for key in reader.keys)


@dataclass(frozen=True)
class NamedClass:
    """A class the engine imports for a child: ``name`` from ``module``, set at ``key`` of the child."""

    key: FieldPath
    module: str
    name: str


def readers(child: ChildConfig) -> list[Reader]:
    """The readers of ``child``'s config kvcompose knows (none for an out-of-tree connector)."""
    if child.module_path is not None:
        return []
    if child.connector in NIXL_CONNECTORS:
        return [NIXL]
    if child.connector != OFFLOADING_CONNECTOR.name:
        return []
    spec = child.config.get("spec_name") or "CPUOffloadingSpec"
    if not isinstance(spec, str):
        return [OFFLOADING_CONNECTOR]
    if spec in BUILTIN_SPECS:
        return [OFFLOADING_CONNECTOR, CPU_SPEC]
    if (spec, child.config.get("spec_module_path")) == (KVCOMPOSE_SPEC_NAME, KVCOMPOSE_SPEC_MODULE):
        return [OFFLOADING_CONNECTOR, KVCOMPOSE_SPEC]
    return [OFFLOADING_CONNECTOR]


def settings_problems(child: ChildConfig, index: int) -> list[Problem]:
    """Every known key of ``child``'s config with a value vLLM cannot read, and what is missing."""
    config, at = child.config, ("children", index, "config")
    child_readers = readers(child)
    problems = []
    known: dict[str, Reader] = {}
    for reader in child_readers:
        known.update(dict.fromkeys(reader.keys, reader))
        problems += [Problem(at, f"{key} is required by {reader.name}") for key in reader.required
                     if config.get(key) is None]
    for key, value in config.items():
        reader = known.get(key)
        if reader is None:
            if child_readers and key not in _EVERY_KEY and (suggestion := did_you_mean(key, known)):
                problems.append(Problem((*at, key), f"{child.connector} reads no {key!r}; did you mean "
                                        f"{suggestion!r}?", warning=True))
        elif value is not None and not (expected := reader.keys[key]).accepts(value):
            problems.append(Problem((*at, key), f"{shown(value)} is not {expected.description}: {reader.name} "
                                    f"{expected.reads}"))
    if OFFLOADING_CONNECTOR in child_readers:
        problems += _offloading_problems(config, at)
    return problems


def _offloading_problems(config: Mapping[str, Any], at: FieldPath) -> list[Problem]:
    problems = []
    if config.get("block_size") is not None and config.get("blocks_per_chunk") is not None:
        problems.append(Problem((*at, "blocks_per_chunk"), "set block_size or blocks_per_chunk, not both"))
    spec = config.get("spec_name")
    if isinstance(spec, str) and spec not in BUILTIN_SPECS and config.get("spec_module_path") is None:
        problems.append(Problem((*at, "spec_name"), f"{spec!r} is not one of vLLM's offloading specs "
                                f"({', '.join(sorted(BUILTIN_SPECS))}); set spec_module_path to its module"))
    policy = config.get("eviction_policy")
    if (isinstance(policy, str) and policy not in BUILTIN_EVICTION_POLICIES
            and config.get("cache_policy_module_path") is None):
        problems.append(Problem((*at, "eviction_policy"), f"{policy!r} is not one of "
                                f"{', '.join(BUILTIN_EVICTION_POLICIES)}; set cache_policy_module_path for "
                                "an out-of-tree policy"))
    return problems


def named_classes(child: ChildConfig) -> list[NamedClass]:
    """The classes the engine will import for ``child``: its connector and, for OffloadingConnector,
    an out-of-tree spec or cache policy."""
    if child.module_path is not None:
        return [NamedClass(("module_path",), child.module_path, child.connector)]
    if child.connector != OFFLOADING_CONNECTOR.name:
        return []
    config = child.config
    named = []
    spec, spec_module = config.get("spec_name"), config.get("spec_module_path")
    if isinstance(spec, str) and isinstance(spec_module, str) and spec not in BUILTIN_SPECS:
        named.append(NamedClass(("config", "spec_module_path"), spec_module, spec))
    policy, policy_module = config.get("eviction_policy"), config.get("cache_policy_module_path")
    if isinstance(policy, str) and isinstance(policy_module, str) and policy not in BUILTIN_EVICTION_POLICIES:
        named.append(NamedClass(("config", "cache_policy_module_path"), policy_module, policy))
    return named
