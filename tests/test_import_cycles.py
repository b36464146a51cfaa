"""No llmlab module imports, directly or through others, a module that imports it back.

``scripts/import_cycles.py`` reads the import graph from the source (module-level and deferred
imports alike); a cycle fails here with the modules that form it and one path that closes it.
"""

from __future__ import annotations

from pathlib import Path

from scripts.import_cycles import cycles, discover, import_graph, shortest_cycle


def test_no_import_cycle_in_any_llmlab_package():
    graph = import_graph()
    assert any(name.startswith("llmlab.tokenizer.") for name in graph)  # it read the sources
    found = {
        ", ".join(group): " -> ".join(shortest_cycle(graph, group[0], set(group)))
        for group in cycles(graph)
    }
    assert found == {}


def _tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = root / "llmlab" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return discover([root])


def test_deferred_and_relative_imports_count_type_checking_ones_do_not(tmp_path):
    modules = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from llmlab.pkg import b\n",
            "pkg/b.py": "def later():\n    from . import a\n",
            "pkg/c.py": "import typing\nif typing.TYPE_CHECKING:\n    from .d import D\n",
            "pkg/d.py": "import llmlab.pkg.c\n",
        },
    )
    graph = import_graph(modules)
    assert graph["llmlab.pkg.b"] == {"llmlab.pkg.a"}
    assert graph["llmlab.pkg.c"] == set()
    assert cycles(graph) == [["llmlab.pkg.a", "llmlab.pkg.b"]]
    assert shortest_cycle(graph, "llmlab.pkg.a", {"llmlab.pkg.a", "llmlab.pkg.b"}) == [
        "llmlab.pkg.a",
        "llmlab.pkg.b",
        "llmlab.pkg.a",
    ]


def test_importing_a_name_from_the_package_init_is_an_edge_to_the_init(tmp_path):
    modules = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "from llmlab.pkg.a import thing\n",
            "pkg/a.py": "thing = 1\ndef f():\n    from llmlab.pkg import thing\n",
        },
    )
    assert cycles(import_graph(modules)) == [["llmlab.pkg", "llmlab.pkg.a"]]


def test_a_c_extension_is_a_leaf_module(tmp_path):
    """``from pkg import _core`` names the compiled submodule (its source ``pkg/_core.c``), not
    the package's ``__init__``, which imports the importer back."""
    modules = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "from llmlab.pkg.a import thing\n",
            "pkg/a.py": "from llmlab.pkg import _core\nthing = 1\n",
            "pkg/_core.c": "/* PyInit__core */\n",
        },
    )
    graph = import_graph(modules)
    assert graph["llmlab.pkg.a"] == {"llmlab.pkg._core"} and graph["llmlab.pkg._core"] == set()
    assert cycles(graph) == []
