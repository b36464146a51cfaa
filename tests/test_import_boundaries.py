"""Who may import ``tests``: only test code, and a test module never imports another test module.

``benchmarks/`` and ``scripts/`` are run by users who may not have the test tree (an installed
wheel, a trimmed checkout), so they import the packages, never ``tests``. A test module
(``test_*.py``) that imports another one runs that module's tests' setup on import and couples two
files that should change alone: shared pieces belong in ``tests/helpers/`` (or a non-test module
next to the tests). Read statically with ``ast``: deferred imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, dotted module)`` for every absolute import in ``path``, module level or deferred.

    ``from a.b import c`` yields ``a.b`` and ``a.b.c`` (``c`` may be a submodule).
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def offending(paths: list[Path], bad: callable) -> list[str]:
    return sorted(
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in paths
        for line, module in imported_modules(path)
        if bad(module)
    )


def is_test_module(module: str) -> bool:
    return module.split(".")[0] == "tests" and module.split(".")[-1].startswith("test_")


def test_benchmarks_and_scripts_never_import_tests():
    files = sorted([*REPO.glob("benchmarks/**/*.py"), *REPO.glob("scripts/**/*.py")])
    assert len(files) > 10  # it found the sources
    assert offending(files, lambda m: m == "tests" or m.startswith("tests.")) == []


def test_no_test_module_imports_another_test_module():
    files = sorted(REPO.glob("tests/**/*.py"))
    assert len(files) > 50
    assert offending(files, is_test_module) == []


def test_the_scan_sees_deferred_and_from_imports(tmp_path):
    src = tmp_path / "bench.py"
    src.write_text(
        "import os\n"
        "from tests.helpers import distributed\n"
        "def f():\n"
        "    from tests.parallel import test_mesh\n"
        "    import tests.train.test_config as c\n"
        "from . import sibling\n"
    )
    modules = [m for _, m in imported_modules(src)]
    assert modules == [
        "os",
        "tests.helpers",
        "tests.helpers.distributed",
        "tests.parallel",
        "tests.parallel.test_mesh",
        "tests.train.test_config",
    ]
    assert [m for m in modules if is_test_module(m)] == [
        "tests.parallel.test_mesh",
        "tests.train.test_config",
    ]


# Which llmlab packages each package may import (its own always):
# docs/architecture.md#who-may-import-whom.
ALLOWED = {
    "tokenizer": set(),
    "kernels": set(),
    "models": {"kernels"},
    "decoding": set(),
    "serving": {"decoding", "models", "tokenizer", "kernels"},  # never train or parallel
    "parallel": set(),
    "train": {"tokenizer", "kernels", "models", "decoding", "parallel", "serving"},
}


def test_packages_import_only_what_the_architecture_allows():
    from scripts.import_cycles import import_graph

    graph = import_graph()
    assert {name.split(".")[1] for name in graph} <= set(ALLOWED)  # a new package is listed
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if target.split(".")[1] != module.split(".")[1]
        and target.split(".")[1] not in ALLOWED[module.split(".")[1]]
    )
    assert wrong == []
