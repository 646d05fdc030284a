"""No import cycles in the package: every module's imports at load time (TYPE_CHECKING blocks and the
imports inside functions aside) form a graph without cycles, so a layer never needs one above it to load.
A submodule's implicit import of its own package does not count: Python initialises the package first."""

from __future__ import annotations

import ast
from pathlib import Path

import llmserve

ROOT = Path(llmserve.__file__).parent


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def load_time_imports(tree: ast.Module, package: str) -> set[str]:
    """The modules (and names) imported by the module's own body, outside `if TYPE_CHECKING:`."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If | ast.Try | ast.With):
                for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                    visit(block)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for imported in load_time_imports(ast.parse(path.read_text()), package):
            while imported and imported not in modules:  # `from m import name`: the module m
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                edges.add(imported)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_package_has_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_a_cycle_would_be_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles(import_graph() | {"llmserve.contracts": {"llmserve.engine.core"}}) != []
