"""A contract with vLLM: the classes and fields kvcompose reads, by dotted name, and what of them a vLLM lacks.

vLLM's experimental classes change shape between releases. Code that reads
them names what it reads in one mapping, dotted name of a class -> the names
it reads of it (attributes, or constructor parameters: dataclass fields,
``__init__`` arguments), and checks the installed vLLM against it once,
instead of reading with defaults that hide a rename.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvcompose.logs import get_logger

logger = get_logger("adapters")

Contract = Mapping[str, tuple[str, ...]]  # dotted name of a vLLM object -> names it must have


def default_lookup(dotted: str) -> Any | None:
    """Import the longest importable module prefix of ``dotted`` and walk the rest; None if absent."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            found = getattr(found, name, None)
            if found is None:
                return None
        return found
    return None


def _has(obj: Any, name: str) -> bool:
    if hasattr(obj, name):
        return True
    try:
        return name in inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False


def missing_names(obj: Any, dotted: str, names: Iterable[str]) -> list[str]:
    """``dotted.name`` for each of ``names`` that ``obj`` has neither as attribute nor as constructor parameter."""
    return [f"{dotted}.{name}" for name in names if not _has(obj, name)]


def missing_api(contract: Contract, lookup: Callable[[str], Any | None] = default_lookup) -> list[str]:
    """Every name of ``contract`` the vLLM seen through ``lookup`` lacks, in the contract's order."""
    missing: list[str] = []
    for dotted, names in contract.items():
        obj = lookup(dotted)
        if obj is None:
            missing.append(dotted)
        else:
            missing.extend(missing_names(obj, dotted, names))
    return missing


def installed_vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def unmet(connector: str, missing: Sequence[str]) -> tuple[str, ...]:
    """``missing`` of an adapter's contract, warned about (once per process: adapters cache their answer)."""
    if missing:
        logger.warning("this vLLM breaks kvcompose's adapter of a connector: it reads nothing of it, so that "
                       "connector's transfers or copy times are not recorded", connector=connector,
                       vllm=installed_vllm_version(), lacks=list(missing))
    return tuple(missing)
