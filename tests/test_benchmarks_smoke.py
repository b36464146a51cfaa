"""Every benchmark runs end to end in its smoke mode, so ``make bench`` cannot break unnoticed.

``benchmarks.run_all.discover`` finds the benchmark modules exactly as ``make bench`` does; each
runs as ``python -m benchmarks.<name> --smoke`` in its own process (tiny sizes, one repeat),
two at a time.
It must exit 0, report through ``benchmarks.common.report`` (a JSON with rows, or a reason it
was skipped, such as "no CUDA") into the scratch directory it was given, and leave the
committed figures in ``benchmarks/results`` untouched. Speed is never asserted: smoke figures
mean nothing. A failure shows the tail of the benchmark's own output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks.common import RESULTS_DIR, RESULTS_ENV, Row, fair, fairness_problems, untimed
from benchmarks.run_all import discover
from tests.helpers.runs import REPO, train_env


def _committed_results() -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in RESULTS_DIR.rglob("*") if p.is_file()}


def test_every_benchmark_module_is_discovered() -> None:
    """The list the smoke runs take is make bench's, and it is not empty or padded."""
    names = discover()
    assert {"llama", "decoding", "train", "kernels"} <= set(names), names
    assert "zero_workload" not in names and "common" not in names


def _smoke_run(name: str, root: Path) -> tuple[subprocess.CompletedProcess, Path]:
    scratch = root / name / "results"
    env = train_env(root / name / "outputs", **{RESULTS_ENV: str(scratch)})
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return proc, scratch


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every benchmark's smoke run, two at a time (one per core: most are single-process, so
    the pair keeps both cores busy), with the committed results' state before and after."""
    root = tmp_path_factory.mktemp("bench-smoke")
    before = _committed_results()
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(discover(), pool.map(lambda n: _smoke_run(n, root), discover())))
    return {"runs": runs, "before": before, "after": _committed_results()}


@pytest.mark.parametrize("name", discover())
def test_benchmark_smoke_run(name: str, smoke_runs: dict) -> None:
    proc, scratch = smoke_runs["runs"][name]
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"benchmarks.{name} --smoke exited {proc.returncode}:\n{tail}"
    written = sorted(scratch.glob("*.json"))
    assert written, f"benchmarks.{name} --smoke reported nothing into {scratch}:\n{tail}"
    for path in written:
        payload = json.loads(path.read_text())
        assert payload["rows"] or payload["skipped"], (path.name, payload)
        for row in payload["rows"]:
            assert row["llmlab"] == row["llmlab"] and row["reference"] == row["reference"], row


def test_smoke_runs_leave_the_committed_results_alone(smoke_runs: dict) -> None:
    assert smoke_runs["after"] == smoke_runs["before"], "a smoke run wrote into benchmarks/results"


# ---------------------------------------------------------------- fair rows (issue 41)
# Benchmarks whose every row records how it was timed (benchmarks.common.fair / untimed): both
# sides cold or both warm, the same number of timed and warm-up runs, the engines compared.
FAIR_BENCHMARKS = ("tokenizer", "data", "serving", "moe", "finetune")


@pytest.mark.parametrize("name", FAIR_BENCHMARKS)
def test_rows_say_how_they_were_timed(name: str, smoke_runs: dict) -> None:
    """Every row of these benchmarks records its timing rules, and a timed row whose two sides
    run the same code (a ratio of noise around 1) carries no target."""
    proc, scratch = smoke_runs["runs"][name]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [row for p in scratch.glob("*.json") for row in json.loads(p.read_text())["rows"]]
    assert rows
    problems = {
        row["name"] + " vs " + row["reference_name"]: fairness_problems(row) for row in rows
    }
    assert not {k: v for k, v in problems.items() if v}, problems


def test_fairness_check_catches_an_unfair_row() -> None:
    """The control: the check finds a missing record and a target on a same-code timed row."""
    same = Row("fast path", 1.0, 1.0, "tiktoken", "MB/s", target=1.0,
               extra=fair(True, 3, 0, ("tiktoken", "tiktoken")))  # fmt: skip
    rows = [{**asdict(r), "target": r.target} for r in (same, Row("x", 1, 1, "y", "s"))]
    assert fairness_problems(rows[0]) == [
        "a target on a timed row whose two sides both run tiktoken"
    ]
    assert "no cold/warm record" in fairness_problems(rows[1])
    assert "no count of timed runs" in fairness_problems(rows[1])
    ok = asdict(Row("fast path", 1.0, 1.0, "tiktoken", "MB/s", extra=same.extra))
    assert fairness_problems(ok) == []
    assert fairness_problems(asdict(Row("m", 1, 1, "y", "MB", target=0.5,
                                        extra=untimed(("loader", "loader"))))) == []  # fmt: skip


def test_clear_caches_leaves_every_tokenizer_cold() -> None:
    """The tokenizer benchmark times llmlab's encoders cold: ``clear_caches`` empties every cache
    an encoder keeps between calls (found by ``cache_entries``), and the ids do not change."""
    from benchmarks.tokenizer import cache_entries, clear_caches
    from llmlab.tokenizer import (
        BPETokenizer,
        SentencePieceBPETokenizer,
        UnigramTokenizer,
        WordBPETokenizer,
        WordPieceTokenizer,
    )

    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex a jug"
    lines = [" ".join(words.split()[i:] + words.split()[:i]) for i in range(16)] * 4
    encoders = {
        "byte-level (reference encoder)": BPETokenizer.train(lines, 300).with_backend("reference"),
        "end-of-word BPE": WordBPETokenizer.train(lines, 300),
        "WordPiece": WordPieceTokenizer.train(lines, 300),
        "SentencePiece BPE": SentencePieceBPETokenizer.train(lines, 320),
        "Unigram": UnigramTokenizer.train(lines, 120),
    }
    for name, tok in encoders.items():
        cold = tok.encode_ordinary_batch(lines)
        assert cache_entries(tok) > 0, f"{name}: no cache found (where does it keep one now?)"
        assert clear_caches(tok) is tok and cache_entries(tok) == 0, name
        assert tok.encode_ordinary_batch(lines) == cold, name
