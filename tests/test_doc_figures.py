"""Every measured figure in the docs is SUMMARY.md's (issue 41), or says that it is history.

The figures: ratios written ``N×`` (or ``Nx``) and percentages ``N %`` / ``N%`` outside code
blocks in README.md, the package READMEs, kernels/README.md and docs/*.md. A range
(``2.5-4.9×``) is two figures. Each must equal, at the precision it is written with, a number of
``benchmarks/results/SUMMARY.md`` (a percentage: that number or 100 times it), looked up in the
sections of the benchmarks its paragraph cites (``benchmarks/<name>.py``,
``python -m benchmarks.<name>``), or in the whole file where the paragraph cites none.

Not checked, by these rules and no others:

- shapes and layouts: a number after which ``×`` or ``x`` is followed by another number
  (``2 × 2``, ``4x256``, ``2×1×2``);
- bounds: a figure right after ``≥``, ``≤``, ``>=``, ``<=``, ``±``, ``within``, ``at least``,
  ``at most``, ``target`` or ``target of`` (a test's tolerance, a benchmark's target);
- history: a paragraph (lines up to a blank line; a table is one) holding the marker
  ``(history, measured YYYY-MM-DD on <machine>)``. The READMEs hold no dates
  (``test_docs.py``), so their figures are always SUMMARY's;
- figures that are not measurements (design arithmetic, a setting, a factor a test uses): on a
  line that ends with ``<!-- not measured: <why> -->``; the marker covers its own line only.

A made-up figure fails (``test_a_made_up_figure_fails``). docs/performance.md explains the rule
to people who write docs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.docs import BLOCK, DOCS, REPO

SUMMARY = REPO / "benchmarks/results/SUMMARY.md"
# a number, a range of two, then × / x (not followed by another number or a letter) or %
FIGURE = re.compile(
    r"(?<![\w.,])(?P<lo>\d+(?:\.\d+)?)(?:\s?(?:-|–|\.\.)\s?[+−-]?(?P<hi>\d+(?:\.\d+)?))?"
    r"(?:(?P<ratio>\s?×|x)(?!\s?[\d(]|\w)|\s?(?P<percent>%))"
)
BOUND = re.compile(
    r"(?:≥|≤|>=|<=|±|\bwithin|\bat least|\bat most|\btarget(?: of)?)\s*[+−-]?$", re.I
)
HISTORY = re.compile(r"\(history, measured 20\d\d-\d\d-\d\d on [^)]+\)")
NOT_MEASURED = re.compile(r"<!-- not measured: .+ -->\s*$")
CITED = re.compile(r"benchmarks[./](\w+)")
SECTION = re.compile(
    r"<!-- benchmark: (?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- end: (?P=name) -->", re.S
)
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[+-]?\d+)?")


def summary_numbers(text: str) -> dict[str, list[float]]:
    """The numbers of each SUMMARY section (cells and notes), by benchmark name."""
    return {
        m["name"]: [float(n) for n in NUMBER.findall(m["body"].replace(",", ""))]
        for m in SECTION.finditer(text)
    }


def paragraphs(text: str):
    """(first line number, lines) of each block of non-blank lines outside code blocks."""
    blank = BLOCK.sub(lambda m: "\n" * m.group().count("\n"), text)  # keeps line numbers
    start, block = 1, []
    for number, line in enumerate(blank.split("\n"), 1):
        if line.strip():
            if not block:
                start = number
            block.append(line)
        elif block:
            yield start, block
            block = []
    if block:
        yield start, block


def found(figure: str, percent: bool, numbers: list[float]) -> bool:
    decimals = len(figure.partition(".")[2])
    value = float(figure)
    return any(
        round(x, decimals) == value or (percent and round(100 * x, decimals) == value)
        for x in numbers
    )


def unsourced(text: str, sections: dict[str, list[float]]) -> list[str]:
    """``line: figure`` for each checked figure of ``text`` that SUMMARY does not hold."""
    everything = [x for numbers in sections.values() for x in numbers]
    missing = []
    for start, lines in paragraphs(text):
        if any(HISTORY.search(line) for line in lines):
            continue
        cited = [n for n in CITED.findall(" ".join(lines)) if n in sections]
        numbers = [x for n in cited for x in sections[n]] if cited else everything
        for offset, line in enumerate(lines):
            if NOT_MEASURED.search(line):
                continue
            for m in FIGURE.finditer(line):
                if BOUND.search(line[: m.start()]):
                    continue
                ends = [m["lo"], m["hi"]] if m["hi"] else [m["lo"]]
                if not all(found(end, bool(m["percent"]), numbers) for end in ends):
                    where = f"SUMMARY's {', '.join(cited)}" if cited else "SUMMARY.md"
                    missing.append(f"{start + offset}: {m.group().strip()} (not in {where})")
    return missing


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", DOCS, ids=_relative)
def test_every_measured_figure_is_summarys(path: Path) -> None:
    sections = summary_numbers(SUMMARY.read_text(encoding="utf-8"))
    missing = unsourced(path.read_text(encoding="utf-8"), sections)
    assert not missing, (
        f"{_relative(path)}: figures that benchmarks/results/SUMMARY.md does not hold (take "
        "SUMMARY's, or mark the paragraph as history or the line as not measured: "
        f"tests/test_doc_figures.py says how): {missing}"
    )


SECTIONS = {"checkpoint": [1.23, 0.4875, 4.1], "train": [0.905, 0.4633]}


def test_a_made_up_figure_fails() -> None:
    """The control: figures SUMMARY does not hold fail, where they are looked up and elsewhere;
    SUMMARY's own (rounded as written), bounds, layouts and marked lines pass."""
    made_up = [
        "Saving sharded (`benchmarks/checkpoint.py`) is 2.4× faster.",  # the train section's
        "MFU reaches 57 % (`python -m benchmarks.train`).",
        "The engine is 7.77× as fast as HF.",
        "Encoding runs 1.23-9.99x HF's speed.",
    ]
    for text in made_up:
        assert unsourced(text, SECTIONS), text
    fine = [
        "Saving sharded (`benchmarks/checkpoint.py`) is 1.2× faster, writing 4.1× fewer bytes.",
        "MFU 46 % and Lightning/raw 0.91× (`benchmarks/train.py`).",
        "At 2 × 2 × 2 and 2×1×2 with a 4x256 GPT, the target is ≥ 0.95× and within 5 %.",
        "A factor that a test uses, 65,536× <!-- not measured: fp16's loss scale -->",
        "Llama ends 9.1 % lower (history, measured 2026-12-03 on 2 CPU cores).",
    ]
    for text in fine:
        assert not unsourced(text, SECTIONS), (text, unsourced(text, SECTIONS))
    # a history marker covers its paragraph, not the next one
    assert unsourced("(history, measured 2026-12-03 on 2 cores) 9.1 %\n\nnow 9.1 %", SECTIONS)
