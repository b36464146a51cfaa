"""docs/seed-map.md stays true: every topic of the course notes has its row, every link resolves
(files, headings, test functions), every SUMMARY row it names exists in that section, and the
figures it embeds exist, are PNGs and stay small. The control tests feed the checks a broken
page and expect each break to be reported.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.docs import BLOCK

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs/seed-map.md"
FIGURES = REPO / "docs/figures"
SUMMARY = REPO / "benchmarks/results/SUMMARY.md"
MAX_BYTES = 150_000  # per figure: scripts/figures.py holds the same bound
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COLUMNS = ["topic", "module", "experiment", "test", "benchmark"]

# The notes' topics, article by article, spelled as the doc's first column spells them.
TOPICS = {
    "Distributed model parallelism": [
        "Model parallel training",
        "Pipeline parallelism (PP)",
        "Naive model parallel (ResNet-50 split by layers)",
        "GPipe: micro-batches and the bubble",
        "1F1B: one forward, one backward",
    ],
    "Distributed GPU training": [
        "Data parallelism (splitting the data)",
        "Single node multi-GPU",
        "DDP (Distributed Data Parallel)",
        "Parameter server",
        "Model parallelism (splitting the model)",
        "Pipeline parallel (PP)",
        "Tensor parallel (TP)",
        "Communicating gradients across GPUs",
        "Multi-GPU communication (collectives)",
    ],
    "Mixed precision training and memory reuse": [
        "Why lower precision: memory, transfers, FLOPS",
        "FP16 and FP8 forward and backward, FP32 optimizer",
        "Limited dynamic range: small updates lost, overflow",
        "FP8 (H100)",
        "Memory reuse in the self-attention backward",
    ],
    "Transformer acceleration strategies": [
        "The four stages of a training step",
        "Kernel fusion",
        "Reducing synchronization",
    ],
    "GPU acceleration strategies: tiled matrix multiplication": [
        "One thread per output element (naive matmul)",
        "Tiling with shared memory",
        "Why tiles cannot grow without bound",
        "CUDA memory model",
    ],
    "GPU memory access and sparse matrices": [
        "Memory parallelism and access locality",
        "Coalesced access",
        "Sparse matrix multiplication",
        "The cuBLAS library",
    ],
    "LLM decoding": ["Exhaustive search", "Greedy decoding", "Beam search", "Sampling"],
    "LLM tokenizers": ["Byte Pair Encoding (BPE)", "Building the BPE vocabulary"],
}

LINK = re.compile(r"(!?)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
SECTION = re.compile(r"<!-- benchmark: (?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- end: ", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _outside_code(text: str) -> str:
    return BLOCK.sub("", text)


def anchors_of(path: Path) -> set[str]:
    """Headings of a Markdown file; ``def`` names (test functions) of a Python file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return set(re.findall(r"^(?:async )?def (\w+)", text, re.M))
    return {slug(h) for h in HEADING.findall(_outside_code(text))}


def link_problems(text: str, where: Path) -> list[str]:
    """Each relative link of ``text`` (a page at ``where``) that does not resolve, and each
    embedded image that is missing, not a PNG or over the size bound."""
    problems = []
    for bang, target in LINK.findall(_outside_code(text)):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        name, _, anchor = target.partition("#")
        path = (where.parent / name).resolve() if name else where
        if not path.is_file():
            problems.append(f"{target}: no such file")
            continue
        if anchor and anchor not in anchors_of(path):
            kind = "test function" if path.suffix == ".py" else "heading"
            problems.append(f"{target}: no {kind} {anchor!r} in {path.name}")
        if bang:
            data = path.read_bytes()
            if not data.startswith(PNG_MAGIC):
                problems.append(f"{target}: not a PNG")
            if len(data) > MAX_BYTES:
                problems.append(f"{target}: {len(data)} bytes, over {MAX_BYTES}")
    return problems


def table_rows(text: str) -> list[list[str]]:
    """The cells of every table row (header and separator rows left out)."""
    rows = []
    for line in _outside_code(text).splitlines():
        if line.startswith("|") and not re.match(r"^\|[\s|:-]+\|$", line):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells != COLUMNS:
                rows.append(cells)
    return rows


def summary_rows(summary_text: str) -> dict[str, list[str]]:
    """The case names of each SUMMARY section (first cell of its table rows)."""
    sections = {}
    for m in SECTION.finditer(summary_text):
        cases = re.findall(r"^\| (.+?) \|", m["body"], re.M)
        sections[m["name"]] = [c for c in cases if c not in ("case", "---")]
    return sections


def benchmark_problems(text: str, summary_text: str) -> list[str]:
    """Each SUMMARY row a benchmark cell names (in backticks, after its section's link) that
    the section does not have, and each cell that cites an unknown section."""
    sections = summary_rows(summary_text)
    problems = []
    for cells in table_rows(text):
        cell = cells[-1]
        for link in re.finditer(r"\]\([./]*benchmarks/results/SUMMARY\.md#([\w-]+)\)", cell):
            name = link[1]
            if name not in sections:
                problems.append(f"{cells[0]}: no SUMMARY section {name!r}")
                continue
            following = cell[link.end() :].split("](", 1)[0]  # up to the next link
            for row in re.findall(r"`([^`]+)`", following):
                if not any(row in case for case in sections[name]):
                    problems.append(f"{cells[0]}: no row {row!r} in SUMMARY's {name}")
    return problems


def topic_problems(text: str, topics: dict[str, list[str]]) -> list[str]:
    """Each article missing as a ``##`` heading, each topic missing as a row's first cell, and
    each row whose cell count is not the five columns'."""
    headings = {h.strip() for h in re.findall(r"^## (.+)$", _outside_code(text), re.M)}
    rows = table_rows(text)
    first = {cells[0].removesuffix(" †") for cells in rows}
    problems = [f"article {a!r}: no heading" for a in topics if a not in headings]
    problems += [f"topic {t!r}: no row" for ts in topics.values() for t in ts if t not in first]
    problems += [f"{cells[0]}: {len(cells)} cells" for cells in rows if len(cells) != 5]
    return problems


# ------------------------------------------------------------------ the page itself
def test_every_topic_of_the_notes_has_its_row() -> None:
    assert not topic_problems(DOC.read_text(encoding="utf-8"), TOPICS)


def test_links_images_and_anchors_resolve() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert not link_problems(text, DOC)
    anchored = [t for _, t in LINK.findall(text) if "#test_" in t]
    assert len(anchored) >= len(TOPICS), "each article's rows name their test functions"


def test_summary_rows_named_exist() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert not benchmark_problems(text, SUMMARY.read_text(encoding="utf-8"))


def test_every_figure_is_embedded_and_small() -> None:
    text = DOC.read_text(encoding="utf-8")
    embedded = {Path(t).name for bang, t in LINK.findall(text) if bang}
    on_disk = {p.name for p in FIGURES.glob("*.png")}
    assert embedded == on_disk, f"embedded only: {embedded - on_disk}, unused: {on_disk - embedded}"
    assert {"step_anatomy.png", "compare_loss.png"} <= on_disk
    assert len([n for n in on_disk if n.startswith("pipeline_")]) == 7  # one per schedule
    for path in FIGURES.glob("*.png"):
        assert path.stat().st_size <= MAX_BYTES, path


def test_pipeline_figures_are_current(tmp_path) -> None:
    """scripts/figures.py draws the pipeline timelines again, byte for byte (pure arithmetic;
    a change to a schedule or to the plot shows here: rerun the script and commit)."""
    proc = subprocess.run(
        [sys.executable, "scripts/figures.py", "--only", "pipeline", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    drawn = sorted(tmp_path.glob("pipeline_*.png"))
    assert len(drawn) == 7
    stale = [p.name for p in drawn if p.read_bytes() != (FIGURES / p.name).read_bytes()]
    assert not stale, f"{stale} differ from docs/figures: run scripts/figures.py --only pipeline"


def test_readme_links_the_seed_map() -> None:
    assert "](docs/seed-map.md)" in (REPO / "README.md").read_text(encoding="utf-8")


# ------------------------------------------------------------------ controls
BROKEN = "\n".join(
    [
        "# A page",
        "",
        "## Distributed model parallelism",
        "",
        "| topic | module | experiment | test | benchmark |",
        "|---|---|---|---|---|",
        "| Model parallel training | [x](../packages/no/such_module.py) | none "
        "| [t](../tests/test_seed_map.py#test_no_such_function) "
        "| [pipeline](../benchmarks/results/SUMMARY.md#pipeline): `bubble nowhere p=9` |",
        "| Naive model parallel (ResNet-50 split by layers) | [h](seed-map.md#no-such-heading) "
        "| none | none | [nope](../benchmarks/results/SUMMARY.md#no_section) |",
        "",
        "![figure](figures/no_such_figure.png)",
        "![not a png](seed-map.md)",
    ]
)


def test_a_broken_page_fails_every_check() -> None:
    """The control: each kind of break is reported, and nothing else."""
    links = link_problems(BROKEN, DOC)
    assert any("such_module.py: no such file" in p for p in links), links
    assert any("no test function 'test_no_such_function'" in p for p in links), links
    assert any("no heading 'no-such-heading'" in p for p in links), links
    assert any("no_such_figure.png: no such file" in p for p in links), links
    assert any("seed-map.md: not a PNG" in p for p in links), links
    assert any("no heading 'no_section' in SUMMARY.md" in p for p in links), links
    assert len(links) == 6, links

    rows = benchmark_problems(BROKEN, SUMMARY.read_text(encoding="utf-8"))
    assert rows == [
        "Model parallel training: no row 'bubble nowhere p=9' in SUMMARY's pipeline",
        "Naive model parallel (ResNet-50 split by layers): no SUMMARY section 'no_section'",
    ], rows

    topics = topic_problems(BROKEN, TOPICS)
    assert "article 'LLM decoding': no heading" in topics
    assert "topic 'GPipe: micro-batches and the bubble': no row" in topics
    assert "article 'Distributed model parallelism': no heading" not in topics
    assert "topic 'Model parallel training': no row" not in topics


def test_the_real_anchors_the_control_relies_on() -> None:
    """The checks accept what exists: a real heading, a real test function, a real row."""
    page = (
        "| a | [h](seed-map.md#figures) | b | [t](../tests/test_seed_map.py#test_the_real_anchors_"
        "the_control_relies_on) | [p](../benchmarks/results/SUMMARY.md#pipeline): "
        "`bubble gpipe p=4 m=8` |"
    )
    assert not link_problems(page, DOC)
    assert not benchmark_problems(page, SUMMARY.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Throughput of the N-D layouts", "throughput-of-the-n-d-layouts"),
        ("The N-D strategy's communication formula", "the-n-d-strategys-communication-formula"),
        ("serving_memory", "serving_memory"),
        (
            "GPU acceleration strategies: tiled matrix multiplication",
            "gpu-acceleration-strategies-tiled-matrix-multiplication",
        ),
    ],
)
def test_slug_is_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor
