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
from pathlib import Path

import pytest

from benchmarks.common import RESULTS_DIR, RESULTS_ENV
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
