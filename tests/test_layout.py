"""The package's shape: data flows one way, and no module imports another that imports it back.

Every import counts: at module level, under ``if TYPE_CHECKING:`` and inside
functions. The layers, each importing only those below it:

    connectors -> instrumentation -> signals (metrics, tracing, economics) -> neutral modules

Neutral modules (the wire formats, the operations, span names, child specs,
the connector adapters, config) import no layer above them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvcompose"

# Each layer's packages and modules, top down.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kvcompose.connectors",),
    ("kvcompose.instrumentation",),
    ("kvcompose.metrics", "kvcompose.tracing", "kvcompose.economics"),
    ("kvcompose.wire", "kvcompose.adapters", "kvcompose.operations", "kvcompose.names", "kvcompose.child_spec",
     "kvcompose.config"),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, modules: set[str]) -> set[str]:
    """The kvcompose modules ``path`` imports, wherever the import stands."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module in modules}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        imported = _imported(path, modules)
        # Importing a submodule runs its packages' __init__ first; a module's own packages are already loading.
        packages = {".".join(module.split(".")[:end]) for module in imported for end in range(2, module.count(".") + 1)}
        graph[name] = {module for module in imported | packages if not name.startswith(module + ".")} - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                return [*path[path.index(imported):], imported]
            if imported not in state and (cycle := visit(imported)) is not None:
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def _layer(module: str) -> int | None:
    for depth, layer in enumerate(LAYERS):
        if any(module == top or module.startswith(top + ".") for top in layer):
            return depth
    return None


def _top(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up the layers."""
    found = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            mine, theirs = _layer(module), _layer(other)
            if mine is None or theirs is None or _top(module) == _top(other):
                continue
            if theirs < mine:
                found.append(f"{module} -> {other}")
    return found


def test_the_package_has_no_import_cycle() -> None:
    graph = _graph()
    assert "kvcompose.instrumentation" in graph["kvcompose.connectors.composite"]  # the graph sees imports
    assert "kvcompose.child_spec" in graph["kvcompose.instrumentation.base"]  # ... under TYPE_CHECKING too
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_no_package_imports_a_package_that_imports_it_back() -> None:
    graph = _graph()
    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        packages.setdefault(_top(module), set()).update(_top(other) for other in imported if _top(other) != _top(module))
    assert _cycle(packages) is None, " -> ".join(_cycle(packages) or [])


def test_data_flows_one_way_through_the_layers() -> None:
    assert _upward(_graph()) == []


def test_a_cycle_and_an_upward_import_are_found_where_there_are_some() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert _upward({"kvcompose.metrics.recorder": {"kvcompose.connectors.children"},
                    "kvcompose.connectors.composite": {"kvcompose.wire.stats"}}) == [
        "kvcompose.metrics.recorder -> kvcompose.connectors.children"]
