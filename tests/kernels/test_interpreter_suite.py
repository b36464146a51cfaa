"""Runs ``tests/kernels/interpreter`` in a child pytest with ``TRITON_INTERPRET=1``.

Why a child process: ``TRITON_INTERPRET`` only takes effect if it is set before ``import
triton`` (see ``tests/kernels/conftest.py``), and in a whole-suite run some other test may have
imported triton first. A fresh interpreter with the variable in its environment is the one
arrangement that cannot be spoiled by test order. The child's output is shown on failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmlab.kernels import interpreter_requested, triton_available

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 300  # Done-when 4: all interpreter tests within 5 minutes on 2 cores


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.skipif(
    interpreter_requested(), reason="TRITON_INTERPRET=1 already: collected in this process"
)
def test_triton_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/kernels/interpreter",
            "-q",
            "-p",
            "no:cacheprovider",
            "--durations=5",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=2 * BUDGET_S,
    )
    elapsed = time.perf_counter() - start
    output = proc.stdout[-8000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"interpreter tests failed (rc={proc.returncode}):\n{output}"
    assert " passed" in proc.stdout, output
    print(f"interpreter suite: {elapsed:.1f}s\n{proc.stdout[-2000:]}")
