"""The GPU benchmark's own code paths, run at toy sizes through the interpreter (``--smoke``).

It cannot measure anything here; it checks that every case builds its inputs, runs llmlab's op
and the references, and produces one row per comparison with finite positive rates.
"""

from __future__ import annotations

import json
import math

import benchmarks.common as common
from benchmarks import kernels as bench


def test_benchmark_dry_run_covers_every_case(tmp_path, monkeypatch):
    monkeypatch.setenv(common.RESULTS_ENV, str(tmp_path))
    assert bench.main(["--smoke"]) == 0
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    names = " | ".join(r["name"] for r in rows)
    for case in (
        "matmul",
        "bias+gelu",
        "residual+layernorm",
        "softmax",
        "rmsnorm",
        "swiglu",
        "a+b+c",
        "attention",
        "GQA",
        "SpMM CSR",
        "SpMV ELL",
        "copy strided",
        "transpose naive",
    ):
        assert case in names, f"{case!r} missing from {names}"
    assert all(math.isfinite(r["llmlab"]) and r["llmlab"] > 0 for r in rows)
    assert {r["reference_name"] for r in rows} >= {"cuBLAS", "SDPA", "eager"}
