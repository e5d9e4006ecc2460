"""Whether a module a pipeline names exists and defines the class it names, found without running it.

The engine imports a child's ``module_path`` (and an offloading spec's
``spec_module_path``) and takes the named class from it. Importing it here
would run it and its parent packages, which usually import vLLM (about 13 s),
and ``kvcompose validate`` answers in well under a second. So the import
system's own finders locate each package on the dotted path, as ``import``
would, and the module's source is parsed, not run, for a top-level definition
of the name. Whatever only running could tell (a module that builds the name
at import time, or fails while importing its own dependencies) passes.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.machinery import ModuleSpec


@dataclass(frozen=True)
class ModuleProblem:
    """Why a module cannot give the engine the class named; ``missing``: the module itself was not found."""

    message: str
    missing: bool = False


def module_problem(module: str, name: str) -> ModuleProblem | None:
    """What stops the engine from taking ``name`` from ``module``, if this environment can tell."""
    if not all(part.isidentifier() for part in module.split(".")):
        return ModuleProblem(f"{module!r} is not a Python module name")
    spec = _find(module)
    if spec is None:
        return ModuleProblem(f"no module {module!r} in this Python environment", missing=True)
    if spec.origin is None or not spec.origin.endswith(".py"):
        return None  # a namespace package or compiled module: only importing it would tell
    try:
        with open(spec.origin, "rb") as source:
            tree = ast.parse(source.read(), spec.origin)
    except SyntaxError as error:
        return ModuleProblem(f"module {module!r} cannot be imported: {error.msg} ({spec.origin}, line {error.lineno})")
    except (OSError, ValueError) as error:
        return ModuleProblem(f"module {module!r} cannot be read: {error}")
    names = _top_level_names(tree.body)
    if names is None or name in names:
        return None
    return ModuleProblem(f"module {module!r} ({spec.origin}) defines no {name!r}")


def _find(module: str) -> ModuleSpec | None:
    """The spec ``import module`` would use, found without running the packages above it."""
    first, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(first)  # a top-level name: nothing is run
    except (ImportError, ValueError):
        return None
    qualified = first
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return None
        qualified = f"{qualified}.{part}"
        spec = importlib.machinery.PathFinder.find_spec(qualified, list(spec.submodule_search_locations))
    return spec


def _top_level_names(statements: Iterable[ast.stmt]) -> set[str] | None:
    """The names a module's top level binds (inside if/try/with blocks too); None where they cannot be
    known without running it (``from x import *`` or a module ``__getattr__``)."""
    names: set[str] = set()
    for statement in statements:
        if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if statement.name == "__getattr__":
                return None
            names.add(statement.name)
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            for alias in statement.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.partition(".")[0])
        elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            names.update(node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name))
        else:
            nested = [*getattr(statement, "body", []), *getattr(statement, "orelse", []),
                      *getattr(statement, "finalbody", []),
                      *(line for handler in getattr(statement, "handlers", []) for line in handler.body)]
            inner = _top_level_names(nested)
            if inner is None:
                return None
            names |= inner
    return names
