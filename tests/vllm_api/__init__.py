"""The connector API of each supported vLLM release, read from its source with ``ast``.

``<version>.json`` beside this module is what one release defines:

- ``classes``: every member of ``KVConnectorBase_V1``, ``SupportsHMA`` and
  ``MultiConnector`` with its kind and parameters (annotations left out);
- ``kv_transfer_config_fields``, ``registered_connectors``;
- ``name_lookups``: connector names vLLM checks with ``has_connector(...)``,
  which sees the connector named in ``--kv-transfer-config`` and MultiConnector's
  children, never a kvcompose child;
- ``child_list_readers``: functions outside MultiConnector that walk its
  private ``_connectors`` list (a kvcompose composite has none).

The sets are extracted from the wheels without installing them (vLLM 0.33 has
no CPU build), so a release kvcompose cannot run here is still checked:
``python -m tests.vllm_api WHEEL...`` writes them. ``tests/test_conformance.py``
compares them with what kvcompose implements, and the installed vLLM with its set.
"""

from __future__ import annotations

import ast
import json
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

API_DIR = Path(__file__).resolve().parent

CONNECTOR_DIR = "vllm/distributed/kv_transfer/kv_connector"
CLASSES = {
    "KVConnectorBase_V1": f"{CONNECTOR_DIR}/v1/base.py",
    "SupportsHMA": f"{CONNECTOR_DIR}/v1/base.py",
    "MultiConnector": f"{CONNECTOR_DIR}/v1/multi_connector.py",
}
KV_TRANSFER_CONFIG = "vllm/config/kv_transfer.py"
FACTORY = f"{CONNECTOR_DIR}/factory.py"
NAME_LOOKUP = "has_connector("
CHILD_LIST = "_connectors"
MULTI_CONNECTOR = CLASSES["MultiConnector"]

# KVTransferConfig fields of 0.30/0.31 that no connector of those releases reads
# (gone in 0.32); kvcompose does not offer them under a child's ``transfer:``.
UNUSED_KV_TRANSFER_FIELDS = frozenset({"kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip"})


class VllmSource:
    """The ``vllm`` package's Python files, from a wheel or an installed package."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._wheel = zipfile.ZipFile(root) if root.is_file() else None

    def read(self, path: str) -> str:
        """The text of ``path`` (``vllm/...``)."""
        if self._wheel is not None:
            return self._wheel.read(path).decode()
        return (self.root.parent / path).read_text()

    def python_files(self) -> Iterator[str]:
        if self._wheel is not None:
            yield from (name for name in self._wheel.namelist() if name.startswith("vllm/") and name.endswith(".py"))
        else:
            yield from (str(path.relative_to(self.root.parent)) for path in sorted(self.root.rglob("*.py")))

    def version(self) -> str:
        match = re.search(r"^__version__ = version = '([^']+)'", self.read("vllm/_version.py"), re.MULTILINE)
        assert match, "vllm/_version.py names no version"
        return match.group(1)


def installed_source() -> VllmSource:
    """The installed vLLM's source, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    return VllmSource(Path(next(iter(spec.submodule_search_locations))))


def extract(source: VllmSource) -> dict[str, Any]:
    """The connector API of one vLLM release."""
    trees: dict[str, ast.Module] = {}

    def tree(path: str) -> ast.Module:
        if path not in trees:
            trees[path] = ast.parse(source.read(path))
        return trees[path]

    return {
        "vllm": source.version(),
        "classes": {name: class_members(tree(path), name) for name, path in CLASSES.items()},
        "kv_transfer_config_fields": _fields(_class(tree(KV_TRANSFER_CONFIG), "KVTransferConfig")),
        "registered_connectors": _registered(tree(FACTORY)),
        "name_lookups": _name_lookups(source),
        "child_list_readers": _child_list_readers(source),
    }


def checked_in_versions() -> list[str]:
    return sorted((path.stem for path in API_DIR.glob("*.json")), key=lambda v: tuple(map(int, v.split("."))))


def checked_in(version: str) -> dict[str, Any]:
    return json.loads((API_DIR / f"{version}.json").read_text())


def write(api: dict[str, Any]) -> Path:
    path = API_DIR / f"{api['vllm']}.json"
    path.write_text(json.dumps(api, indent=1, sort_keys=True) + "\n")
    return path


def _parameters(arguments: ast.arguments) -> str:
    """``(self, request, num_computed_tokens, *, flag=)``: names and kinds; ``=`` marks a default."""
    positional = [*arguments.posonlyargs, *arguments.args]
    defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    parts = [arg.arg + ("=" if default is not None else "") for arg, default in zip(positional, defaults, strict=True)]
    if arguments.posonlyargs:
        parts.insert(len(arguments.posonlyargs), "/")
    if arguments.vararg:
        parts.append(f"*{arguments.vararg.arg}")
    elif arguments.kwonlyargs:
        parts.append("*")
    parts += [arg.arg + ("=" if default is not None else "")
              for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)]
    if arguments.kwarg:
        parts.append(f"**{arguments.kwarg.arg}")
    return f"({', '.join(parts)})"


def class_members(module: ast.Module, name: str) -> dict[str, str]:
    """Member name -> ``kind(parameters)`` (``property``, ``attribute``) of a class defined in ``module``."""
    members: dict[str, str] = {}
    for node in _class(module, name).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            decorators = {_decorator_name(d) for d in node.decorator_list}
            if "property" in decorators:
                members[node.name] = "property"
                continue
            if any(d.endswith(".setter") for d in decorators):
                continue
            kind = next((k for k in ("classmethod", "staticmethod", "abstractmethod") if k in decorators), "method")
            members[node.name] = kind + _parameters(node.args)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members[node.target.id] = "attribute"
        elif isinstance(node, ast.Assign):
            members.update((target.id, "attribute") for target in node.targets if isinstance(target, ast.Name))
    return members


def _class(module: ast.Module, name: str) -> ast.ClassDef:
    found = [node for node in module.body if isinstance(node, ast.ClassDef) and node.name == name]
    assert found, f"no class {name}"
    return found[0]


def _decorator_name(decorator: ast.expr) -> str:
    return ast.unparse(decorator.func if isinstance(decorator, ast.Call) else decorator)


def _fields(cls: ast.ClassDef) -> list[str]:
    return [node.target.id for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)]


def _registered(factory: ast.Module) -> list[str]:
    return sorted(
        node.args[0].value
        for node in ast.walk(factory)
        if _is_call_of(node, "register_connector") and isinstance(node.args[0], ast.Constant)
    )


def _is_call_of(node: ast.AST, method: str) -> bool:
    """``<anything>.method(<at least one argument>)``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method
            and bool(node.args))


def _name_lookups(source: VllmSource) -> list[str]:
    """Every connector name passed to ``has_connector``, literally or from a literal tuple looped over."""
    names: set[str] = set()
    for _, module in _modules_mentioning(source, NAME_LOOKUP, besides=KV_TRANSFER_CONFIG):
        for node in ast.walk(module):
            if _is_call_of(node, "has_connector") and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
            for target, iterable in _loops(node):
                if isinstance(target, ast.Name) and f"has_connector({target.id})" in ast.unparse(node):
                    names |= {elt.value for elt in getattr(iterable, "elts", ()) if isinstance(elt, ast.Constant)}
    return sorted(names)


def _loops(node: ast.AST) -> list[tuple[ast.expr, ast.expr]]:
    """(loop variable, iterable) of a ``for`` statement or a comprehension."""
    if isinstance(node, ast.For):
        return [(node.target, node.iter)]
    if isinstance(node, ast.GeneratorExp | ast.ListComp | ast.SetComp):
        return [(generator.target, generator.iter) for generator in node.generators]
    return []


def _child_list_readers(source: VllmSource) -> list[str]:
    """``path:function`` of each function outside MultiConnector's module that names ``"_connectors"``."""
    readers: set[str] = set()
    for path, module in _modules_mentioning(source, CHILD_LIST, besides=MULTI_CONNECTOR):
        readers |= {
            f"{path}:{node.name}"
            for node in ast.walk(module)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and any(isinstance(inner, ast.Constant) and inner.value == CHILD_LIST for inner in ast.walk(node))
        }
    return sorted(readers)


def _modules_mentioning(source: VllmSource, text: str, besides: str) -> Iterator[tuple[str, ast.Module]]:
    """(path, parsed module) of each module whose source contains ``text``, except the one at ``besides``."""
    for path in source.python_files():
        code = source.read(path)
        if text in code and path != besides:
            yield path, ast.parse(code)
