"""The documentation says what is true: snippets run, links resolve, and the READMEs stay short,
current (no load averages, no dated history: that is CHANGELOG.md's) and in one heading style."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.docs import BLOCK, DOCS, READMES, REPO

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
HISTORY = re.compile(rf"load average|\b20\d\d-\d\d-\d\d\b|\b({MONTHS}) 20\d\d|\bturn \d", re.I)


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO))


def _outside_code(text: str) -> str:
    return BLOCK.sub("", text)


def test_root_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines; docs/architecture.md allows about 300"


def test_no_file_points_outside_the_repository():
    """Code and docs point to docs/architecture.md, never to a design note a clone does not have
    (the two patterns are spelled in pieces so that this file does not match itself)."""
    outside = ["DESIGN" + " §", ".." + "/shared"]
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    found = []
    for name in filter(None, tracked):
        path = REPO / name
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (images)
        found += [f"{name}: {pattern}" for pattern in outside if pattern in text]
    assert not found, found
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "](docs/architecture.md)" in readme, "the root README links docs/architecture.md"


@pytest.mark.parametrize("path", READMES, ids=_relative)
def test_readmes_hold_no_history_or_load_averages(path):
    found = HISTORY.findall(path.read_text(encoding="utf-8"))
    assert not found, f"{_relative(path)}: {found} belongs in CHANGELOG.md"


@pytest.mark.parametrize("path", DOCS, ids=_relative)
def test_relative_links_resolve(path):
    text = _outside_code(path.read_text(encoding="utf-8"))
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://|mailto:|#", target):
            continue
        file = (path.parent / target.split("#")[0]).resolve()
        assert file.exists(), f"{_relative(path)} links to {target}, which does not exist"


@pytest.mark.parametrize("path", DOCS, ids=_relative)
def test_one_heading_style(path):
    """ATX headings, one title, then sentence-case ``##`` / ``###`` sections."""
    headings = re.findall(r"^(#+) (.+)$", _outside_code(path.read_text(encoding="utf-8")), re.M)
    assert headings and headings[0][0] == "#", f"{_relative(path)} must start with one # title"
    for marks, title in headings[1:]:
        assert marks in ("##", "###"), f"{_relative(path)}: {marks} {title}"
        first = title.lstrip("`*[")[:1]
        assert not first.isalpha() or first.isupper(), f"{_relative(path)}: '{title}'"
        words = re.findall(r"(?<![`\w./-])[A-Za-z][a-z]+\b", title)[1:]
        capitalised = [w for w in words if w[0].isupper() and w not in PROPER_NOUNS]
        assert not capitalised, f"{_relative(path)}: '{title}' is not sentence case"


PROPER_NOUNS = {"Lightning", "Unicode", "Triton", "DeepSpeed", "Hydra", "ZeRO", "Megatron", "SLURM"}


def _snippets() -> list[tuple[str, int, str]]:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            if match["lang"] == "python" and not match["why"]:
                line = text[: match.start("code")].count("\n") + 1
                found.append((_relative(path), line, match["code"]))
    return found


RUNNER = textwrap.dedent(
    """
    import json, sys, traceback
    for where, code in json.load(sys.stdin):
        try:
            exec(compile(code, where, "exec"), {"__name__": "__main__"})
        except BaseException:
            print(f"FAILED {where}\\n{traceback.format_exc()}")
            sys.exit(1)
        print(f"ran {where}", flush=True)
    """
)


def test_python_snippets_run(tmp_path):
    """Every ```python block of the READMEs and docs/ runs as written (one process, each block in
    a fresh namespace, in an empty folder); a block that cannot run here says why above it."""
    import json

    snippets = _snippets()
    assert len(snippets) >= 7
    payload = json.dumps([(f"{path}:{line}", code) for path, line, code in snippets])
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=payload,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
