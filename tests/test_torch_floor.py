"""Every distribution's ``torch>=`` floor covers the newest torch API its code calls.

The suite runs on one torch (the pin in constraints.txt), so nothing else notices a floor that
is too low: a user on an older torch would get an ``unexpected keyword argument`` deep inside
training. This table names each API the packages use that arrived late, with the release that
brought it; a package that calls one must declare at least that release (and so must every
package that depends on it). Add a row when you use a newer API.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = {
    "llmlab-kernels": REPO / "kernels",
    "llmlab-models": REPO / "packages/models",
    "llmlab-decoding": REPO / "packages/decoding",
    "llmlab-parallel": REPO / "packages/parallel",
    "llmlab-serving": REPO / "packages/serving",
    "llmlab-train": REPO / "packages/train",
}
#: every distribution declares one floor (FSDP2's fully_shard sets it): a user installs one torch
PROJECT_FLOOR = (2, 6)

#: code pattern -> (torch release that brought it, what it is)
LATE_APIS: dict[str, tuple[tuple[int, int], str]] = {
    r"enable_gqa\s*=": ((2, 5), "F.scaled_dot_product_attention(enable_gqa=)"),
    r"torch\._scaled_mm\(": ((2, 5), "torch._scaled_mm returning one tensor (2.4: out, amax)"),
    r"torch\.distributed\.tensor\b": ((2, 5), "the public torch.distributed.tensor (DTensor)"),
    r"\bfully_shard\b": ((2, 6), "FSDP2's public torch.distributed.fsdp.fully_shard"),
    r"torch\.distributed\.checkpoint": ((2, 2), "torch.distributed.checkpoint with checkpoint_id"),
    r"register_post_accumulate_grad_hook": ((2, 1), "Tensor.register_post_accumulate_grad_hook"),
}


def _declared_floor(pyproject: Path) -> tuple[tuple[int, int], list[str]]:
    project = tomllib.loads(pyproject.read_text())["project"]
    deps = project["dependencies"]
    (torch,) = [d for d in deps if re.match(r"torch\b", d)]
    major, minor = re.fullmatch(r"torch>=(\d+)\.(\d+)", torch.replace(" ", "")).groups()
    llmlab = [re.match(r"[\w-]+", d).group() for d in deps if d.startswith("llmlab-")]
    return (int(major), int(minor)), llmlab


def _needed(source: Path) -> dict[tuple[int, int], list[str]]:
    code = "\n".join(p.read_text() for p in sorted(source.rglob("*.py")))
    found: dict[tuple[int, int], list[str]] = {}
    for pattern, (release, what) in LATE_APIS.items():
        if re.search(pattern, code):
            found.setdefault(release, []).append(what)
    return found


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_torch_floor_covers_the_apis_the_code_calls(name: str) -> None:
    floor, deps = _declared_floor(DISTRIBUTIONS[name] / "pyproject.toml")
    needed = _needed(DISTRIBUTIONS[name] / "src")
    # an llmlab dependency's floor is this package's floor too (llmlab-tokenizer needs no torch)
    for dep in (d for d in deps if d in DISTRIBUTIONS):
        dep_floor, _ = _declared_floor(DISTRIBUTIONS[dep] / "pyproject.toml")
        needed.setdefault(dep_floor, []).append(f"{dep}'s floor")
    top = max(needed, default=(0, 0))
    assert floor >= top, (
        f"{name} declares torch>={floor[0]}.{floor[1]} but needs {top[0]}.{top[1]} for "
        f"{needed[top]}"
    )


def test_the_late_api_table_sees_the_calls_it_names() -> None:
    """The table is not dead: the APIs that set today's floor are found where they are used."""
    assert (2, 5) in _needed(REPO / "kernels/src")  # enable_gqa in the attention reference
    assert (2, 5) in _needed(REPO / "packages/parallel/src")  # torch._scaled_mm in fp8
    assert (2, 2) in _needed(REPO / "packages/parallel/src")  # sharded checkpoints
    assert (2, 6) in _needed(REPO / "packages/parallel/src")  # zero_impl=fsdp2


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_every_distribution_declares_the_project_floor(name: str) -> None:
    floor, _ = _declared_floor(DISTRIBUTIONS[name] / "pyproject.toml")
    assert floor == PROJECT_FLOOR, f"{name} declares torch>={floor}, the project {PROJECT_FLOOR}"
