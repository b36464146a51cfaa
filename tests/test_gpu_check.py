"""``make gpu-check`` on a machine without CUDA: says so and exits 0 (issue 15, done-when 4)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.runs import REPO


def test_gpu_check_without_cuda_says_so_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU even where there is one
    result = subprocess.run(
        [sys.executable, "scripts/gpu_check.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "gpu-check: no CUDA device on this machine" in result.stdout
