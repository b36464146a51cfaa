"""Report import cycles among llmlab's modules, read statically from the source (no imports run).

Every ``import`` and ``from ... import`` counts, at module level or deferred inside a function:
a deferred import only hides a cycle until the function first runs. Imports under
``if TYPE_CHECKING:`` do not count (they never run). ``from pkg import name`` is an edge to the
submodule ``pkg.name`` when one exists, else to ``pkg`` itself (its ``__init__``). A C extension
is known by its source, ``pkg/_name.c`` for ``pkg._name``, and imports nothing of llmlab (a leaf).

    .venv/bin/python scripts/import_cycles.py        # exit 1 and list the cycles if any

``tests/test_import_cycles.py`` runs it on every ``make test``.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = sorted([*REPO.glob("packages/*/src"), REPO / "kernels/src"])


def discover(roots: list[Path] = SOURCE_ROOTS) -> dict[str, Path]:
    """Every module under ``<root>/llmlab``: dotted name -> file (``pkg`` for ``__init__``; the
    ``.c`` source for a C extension)."""
    modules = {}
    for root in roots:
        sources = [*(root / "llmlab").rglob("*.py"), *(root / "llmlab").rglob("*.c")]
        for path in sorted(sources):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, skipping the bodies of ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def edges_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The llmlab modules that module ``name`` imports."""
    if path.suffix == ".c":  # a C extension: a leaf
        return set()
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:  # relative: "." is this package, ".." its parent...
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            targets.add(sub if sub in modules else base)
    out = set()
    for target in targets:
        while target and target not in modules:  # "import a.b.c" of a name inside a module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def import_graph(modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    modules = discover() if modules is None else modules
    return {name: edges_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the groups of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups


def shortest_cycle(graph: dict[str, set[str]], start: str, group: set[str]) -> list[str]:
    """One shortest path start -> ... -> start inside ``group`` (to show how the cycle closes)."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node] & group):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start] if node != start else [start, start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    return [start]


def cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """Each import cycle as its sorted group of modules."""
    graph = import_graph() if graph is None else graph
    return [group for group in strongly_connected(graph) if len(group) > 1]


def main() -> int:
    graph = import_graph()
    found = cycles(graph)
    for group in found:
        path = shortest_cycle(graph, group[0], set(group))
        print(f"import cycle among {len(group)} modules: {', '.join(group)}")
        print("    e.g. " + " -> ".join(path))
    print(f"{len(graph)} modules, {len(found)} import cycle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
