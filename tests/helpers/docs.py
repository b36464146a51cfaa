"""The documents the doc tests read, and how they find code blocks in them (shared by
``tests/test_docs.py`` and ``tests/test_doc_figures.py``)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
READMES = [
    REPO / "README.md",
    REPO / "kernels/README.md",
    *sorted(REPO.glob("packages/*/README.md")),
]
DOCS = [*READMES, *sorted((REPO / "docs").glob("*.md"))]
# A ```python block runs unless the line before it is "<!-- not run: <why> -->".
BLOCK = re.compile(
    r"(?:^<!-- not run: (?P<why>.+?) -->\n)?^```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.M | re.S
)
