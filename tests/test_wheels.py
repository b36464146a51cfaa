"""Each distribution builds a wheel, and ``llmlab-tokenizer``'s works alone, with no torch.

docs/architecture.md#layout: ``pip install packages/tokenizer`` must not pull torch. The test builds
every distribution's wheel with the installed setuptools (no build isolation, so no download),
installs the tokenizer's into a fresh virtual environment without pip (``pip --python`` drives it
from outside) together with its one runtime dependency, ``regex``, from the wheelhouse that
``make install`` fills in ``.venv/wheelhouse`` (the only step that may use the network), and runs
a BPE there: train, encode, decode, save and load. ``--no-index`` keeps the test offline.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DISTRIBUTIONS = {
    "llmlab-tokenizer": REPO / "packages/tokenizer",
    "llmlab-decoding": REPO / "packages/decoding",
    "llmlab-serving": REPO / "packages/serving",
    "llmlab-models": REPO / "packages/models",
    "llmlab-parallel": REPO / "packages/parallel",
    "llmlab-train": REPO / "packages/train",
    "llmlab-kernels": REPO / "kernels",
}
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"
BUILD_LEFTOVERS = ("build", "*.egg-info", "__pycache__", "*.so")  # .so: in-place builds

PROBE = r"""
import json, sys, tempfile
from pathlib import Path
import llmlab.tokenizer as lt
import llmlab.tokenizer.merge_trainer as merge_trainer

text = "To be, or not to be, that is the question.\n" * 50
tok = lt.BPETokenizer.train([text], 300, special_tokens=["<|endoftext|>"])
ids = tok.encode("to be<|endoftext|>", allowed_special="all")
path = lt.save(tok, Path(tempfile.mkdtemp()) / "bpe.json")
again = lt.load(path)
try:
    import torch  # noqa: F401
    torch_found = True
except ImportError:
    torch_found = False
print(json.dumps({
    "file": lt.__file__ if hasattr(lt, "__file__") else list(lt.__path__)[0],
    "ids": ids,
    "roundtrip": again.encode("to be") == tok.encode("to be")
    and tok.decode(ids) == "to be<|endoftext|>",
    "backend": tok.backend,
    "merge_core": merge_trainer._merge_core is not None,
    "torch_found": torch_found,
    "torch_imported": "torch" in sys.modules,
}))
"""


def _run(*args: str | Path, cwd: Path | None = None) -> str:
    proc = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, cwd=cwd, timeout=600
    )
    assert proc.returncode == 0, f"{args[:4]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_the_wheels_build_and_the_tokenizer_runs_alone_without_torch(tmp_path):
    regex_wheels = sorted(WHEELHOUSE.glob("regex-*.whl"))
    assert regex_wheels, f"no regex wheel in {WHEELHOUSE}: run `make install` (it fills it)"
    # Build from clean copies: setuptools builds in the source folder, and a stale build/ there
    # (left by an earlier build) would put modules that no longer exist into the wheel.
    sources = []
    for name, src in DISTRIBUTIONS.items():
        sources.append(tmp_path / "src" / name)
        shutil.copytree(src, sources[-1], ignore=shutil.ignore_patterns(*BUILD_LEFTOVERS))
    dist = tmp_path / "dist"
    _run(
        sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "--no-index", "--wheel-dir", dist, *sources,
    )  # fmt: skip
    built = {p.name.split("-")[0].replace("_", "-") for p in dist.glob("*.whl")}
    assert built == set(DISTRIBUTIONS), f"wheels built: {sorted(built)}"
    # llmlab.kernels.quantized compiles its C++ kernel where it runs: the wheel must carry it
    (kernels,) = dist.glob("llmlab_kernels-*.whl")
    with zipfile.ZipFile(kernels) as wheel:
        assert "llmlab/kernels/cpu/few_row_matmul.cpp" in wheel.namelist()

    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    _run(
        sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-index",
        "--find-links", dist, "--find-links", WHEELHOUSE, "llmlab-tokenizer",
    )  # fmt: skip
    listing = "import importlib.metadata as m; print(sorted(d.name for d in m.distributions()))"
    installed = _run(python, "-c", listing)
    assert "torch" not in installed and "llmlab-tokenizer" in installed

    result = json.loads(_run(python, "-c", PROBE, cwd=tmp_path).strip().splitlines()[-1])
    assert str(env_dir) in result["file"], result["file"]  # the wheel, not the editable source
    assert result["roundtrip"] and result["ids"][-1] == 0  # <|endoftext|> is id 0
    assert result["backend"] == "reference"  # tiktoken is an extra, not a dependency
    # the wheel compiled the merge loop wherever a C compiler is (optional: else Python's loop)
    assert result["merge_core"] or shutil.which("cc") is None
    assert not result["torch_found"] and not result["torch_imported"]


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_every_distribution_names_its_readme(name):
    text = (DISTRIBUTIONS[name] / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(rf'^name = "{name}"$', text, re.M)
    readme = re.search(r'^readme = "([^"]+)"$', text, re.M)
    assert readme, f"{name}: pyproject.toml sets no readme"
    assert (DISTRIBUTIONS[name] / readme.group(1)).is_file(), f"{name}: no {readme.group(1)}"
