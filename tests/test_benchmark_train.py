"""``benchmarks/train.py --smoke`` runs end to end and writes its rows.

Speed is never asserted (DEVELOPERS rule 5); this checks the script itself: every row is
there, each figure is a positive number, and the optimizer rows carry their exactness check.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.common import RESULTS_ENV
from tests.helpers.runs import REPO, train_env


@pytest.mark.slow
def test_train_benchmark_smoke_run_writes_every_row(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.train", "--smoke"],
        cwd=REPO,
        env=train_env(tmp_path, **{RESULTS_ENV: str(tmp_path / "results")}),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    payload = json.loads((tmp_path / "results" / "train.json").read_text())
    names = [row["name"] for row in payload["rows"]]
    for expected in ("(a) llmlab raw loop / (d) litgpt", "(a) llmlab raw loop / (e) HF GPT-2",
                     "(b) Lightning path / (a) raw loop", "MFU of the default experiment",
                     "AdamW step, optimizer_impl=fused"):  # fmt: skip
        assert any(name.startswith(expected) for name in names), (expected, names)
    assert all(row["llmlab"] > 0 and row["reference"] > 0 for row in payload["rows"])
    foreach = next(r for r in payload["rows"] if r["name"].endswith("impl=foreach"))
    assert foreach["extra"]["max_abs_param_diff_vs_default"] == 0.0  # bit-identical
