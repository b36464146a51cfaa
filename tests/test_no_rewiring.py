"""No llmlab module rewires another object: it calls its methods, it never replaces them.

An AST scan of every source file (``packages/*/src``, ``kernels/src``). On an object that is not
the method's own (``self`` / ``cls``), and was not created in the same function, it refuses:

* assigning a function to an attribute: a ``lambda``, a ``def`` of this module, a bound method
  (``plugin.clip_grad_by_norm = self._clip``), ``functools.partial`` or ``types.MethodType``;
* assigning to an attribute that names a method -- of a class defined in these sources, or of
  the torch / Lightning classes llmlab subclasses and drives (``plugin.state_dict = ...``);
* writing one of its private attributes (``plugin._initial = {}``), or swapping its class;
* the same through ``setattr(obj, "name", value)`` with a literal name.

Why: a strategy that replaced its precision plugin's ``state_dict`` and ``clip_grad_by_norm``
made both objects impossible to read on their own; the plugin now exposes what strategies need
as its own methods. The first tests feed the scanner those old patterns, so it can fail.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted([*REPO.glob("packages/*/src/llmlab/**/*.py"), *REPO.glob("kernels/src/**/*.py")])
OWN = ("self", "cls")
FUNCTION_FACTORIES = {"partial", "MethodType"}
# (file, attribute) -> why it must be written there. Keep this short: every entry is a debt.
ALLOWED = {
    ("packages/parallel/src/llmlab/parallel/checkpoint/pretrained.py", "_backward_hooks"): (
        "fill() hands a meta parameter real storage with swap_tensors, which leaves the hook "
        "dict behind unwired; torch has no public call to re-wire it, so fill() clears it and "
        "registers the same hooks again through register_hook"
    ),
}


# The torch and Lightning classes llmlab's objects are or drive, by source file (read, not
# imported: importing Lightning alone costs seconds).
FOREIGN = {
    "torch": ["nn/modules/module.py", "optim/optimizer.py"],
    "lightning": [
        "pytorch/plugins/precision/precision.py",
        "fabric/plugins/precision/precision.py",
        "pytorch/strategies/strategy.py",
        "pytorch/strategies/ddp.py",
        "pytorch/core/module.py",
    ],
}


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # a top-level package: found, not imported
    assert spec is not None and spec.origin is not None, name
    return Path(spec.origin).parent


def _foreign_method_names() -> set[str]:
    """Method names of the torch and Lightning classes in :data:`FOREIGN`."""
    trees = [
        ast.parse((_package_dir(package) / path).read_text())
        for package, paths in FOREIGN.items()
        for path in paths
    ]
    return _method_names(trees)


def _method_names(trees: list[ast.Module]) -> set[str]:
    """Method names of the classes defined in ``trees`` (properties are data)."""
    return {
        item.name
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
        and not item.name.startswith("__")
        and not any(ast.unparse(d).endswith(("property", "setter")) for d in item.decorator_list)
    }


class _Scanner(ast.NodeVisitor):
    """Collects ``(line, what)`` for every rewiring in one module."""

    def __init__(self, tree: ast.Module, methods: set[str]) -> None:
        self.methods = methods
        self.functions = {
            n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        self.class_methods: set[str] = set()
        self.local: list[set[str]] = [set()]
        self.found: list[tuple[int, str]] = []

    # -- scopes: names bound to a new object in this function are its own
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer = self.class_methods
        self.class_methods = {
            n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        self.generic_visit(node)
        self.class_methods = outer

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        created = {
            t.id
            for n in ast.walk(node)
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        self.functions |= {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        self.local.append(created)
        self.generic_visit(node)
        self.local.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    # -- what is assigned where
    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._check(target, node.value, node.lineno)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check(node.target, node.value, node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check(node.target, node.value, node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (
            isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) == 3
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            owner, name, value = node.args
            self._judge(owner, name.value, value, node.lineno)
        self.generic_visit(node)

    def _check(self, target: ast.AST, value: ast.AST | None, line: int) -> None:
        if isinstance(target, ast.Tuple | ast.List):
            values = (
                value.elts if isinstance(value, ast.Tuple | ast.List) else [None] * len(target.elts)
            )
            for t, v in zip(target.elts, values, strict=False):
                self._check(t, v, line)
        elif isinstance(target, ast.Attribute):
            self._judge(target.value, target.attr, value, line)

    def _judge(self, owner: ast.AST, name: str, value: ast.AST | None, line: int) -> None:
        root = owner
        while isinstance(root, ast.Attribute | ast.Subscript):
            root = root.value
        if isinstance(owner, ast.Name) and (owner.id in OWN or owner.id in self.local[-1]):
            return  # the object's own method, or an object this function just made
        if isinstance(root, ast.Name) and root.id in OWN and isinstance(owner, ast.Name):
            return
        if isinstance(owner, ast.Name) and owner.id == "ctx":
            return  # an autograd Function's context: saving attributes on it is its API
        where = ast.unparse(owner)
        if name == "__class__":
            self.found.append((line, f"{where}.__class__ swapped"))
        elif name.startswith("_") and not name.startswith("__"):
            self.found.append((line, f"{where}.{name}: a private attribute of another object"))
        elif name in self.methods and not isinstance(value, ast.Call | ast.Constant):
            # a call's result or a constant is data (``cfg.model = OmegaConf.create(...)``);
            # functions made by a call are caught below (FUNCTION_FACTORIES)
            self.found.append((line, f"{where}.{name}: a method name, assigned from outside"))
        elif value is not None and self._is_function(value):
            self.found.append((line, f"{where}.{name} = {ast.unparse(value)[:40]}: a function"))

    def _is_function(self, value: ast.AST) -> bool:
        if isinstance(value, ast.Lambda):
            return True
        if isinstance(value, ast.Name):
            return value.id in self.functions
        if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
            return value.value.id == "self" and value.attr in self.class_methods
        if isinstance(value, ast.Call):
            func = value.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            return called in FUNCTION_FACTORIES
        return False


def scan(source: str | ast.Module, methods: set[str]) -> list[tuple[int, str]]:
    tree = ast.parse(source) if isinstance(source, str) else source
    scanner = _Scanner(tree, methods)
    scanner.visit(tree)
    return scanner.found


@pytest.fixture(scope="module")
def sources() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in SOURCES}


@pytest.fixture(scope="module")
def methods(sources) -> set[str]:
    return _foreign_method_names() | _method_names(list(sources.values()))


@pytest.mark.parametrize(
    "source",
    [
        # what NDParallelStrategy._wire_precision_plugin and _zero_master_weights did
        "class S:\n    def wire(self, plugin):\n"
        "        plugin.clip_grad_by_norm = self._clip\n    def _clip(self): ...",
        "class S:\n    def wire(self, plugin):\n        plugin.state_dict = lambda: {}",
        "class S:\n    def wire(self, plugin):\n        plugin._initial = {}",
        "def f(layer, cls):\n    layer.__class__ = cls",
        "def f(module, fn):\n    setattr(module, 'forward', fn)",
        "import functools\ndef f(obj, g):\n    obj.hook = functools.partial(g, 1)",
    ],
)
def test_the_scanner_finds_each_kind_of_rewiring(source, methods):
    assert scan(source, methods), source


@pytest.mark.parametrize(
    "source",
    [
        "class S:\n    def set(self, v):\n        self.state_dict = v",  # its own attribute
        "def f(p, view):\n    p.grad = view",  # a tensor's data attribute
        "def f(ctx, group):\n    ctx.group = group",  # an autograd context's slot
        "def f(ctx, shape):\n    ctx.shape = shape",  # even under a method's name
        "def f(cfg, spec):\n    cfg.model = OmegaConf.create(spec)",  # a call's result is data
        "import logging\ndef f():\n    h = logging.StreamHandler()\n    h._tag = 1",  # made here
    ],
)
def test_the_scanner_leaves_plain_data_alone(source, methods):
    assert scan(source, methods) == [], source


def test_no_module_rewires_another_objects_methods(sources, methods):
    found = [
        f"{path.relative_to(REPO)}:{line}: {what}"
        for path, tree in sources.items()
        for line, what in scan(tree, methods)
        if not any(
            str(path.relative_to(REPO)) == file and f".{attr}:" in what for file, attr in ALLOWED
        )
    ]
    assert len(sources) > 100  # it read the sources
    assert found == []
