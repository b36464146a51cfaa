"""In-process kernel tests (no interpreter): the CPU fallback, input validation, sparse formats.

The fallback is what CPU training uses: each public op must run the PyTorch reference, warn
exactly once per op, and still agree with torch.nn.functional (float32, atol/rtol 1e-6: the
same torch ops run underneath).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import llmlab.kernels as K
from llmlab.kernels._runtime import interpreter_requested, reset_fallback_warnings

REPO = Path(__file__).resolve().parents[2]
needs_no_interpreter = pytest.mark.skipif(
    interpreter_requested(), reason="tests the non-interpreter CPU fallback"
)


def test_package_imports_without_triton():
    """triton is an optional extra: with it made unimportable the ops fall back and warn."""
    code = (
        "import sys, warnings, torch\n"
        "sys.modules['triton'] = None\n"  # `import triton` raises, find_spec returns None
        "import llmlab.kernels as K\n"
        "assert not K.triton_available()\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    y = K.gelu(torch.ones(3))\n"
        "assert 'triton is not installed' in str(w[0].message), w\n"
        "print('ok', float(y[0]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok 0.841"), proc.stdout  # gelu_tanh(1) = 0.8412


@needs_no_interpreter
def test_cpu_fallback_matches_torch_and_warns_once_per_op():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 16, requires_grad=True)
    w, b = torch.randn(16), torch.randn(16)
    reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            outs = {
                "layer_norm": (K.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (16,), w, b, 1e-5)),
                "gelu": (K.gelu(x), F.gelu(x, approximate="tanh")),
                "bias_gelu": (K.bias_gelu(x, b), F.gelu(x + b, approximate="tanh")),
                "softmax": (
                    K.softmax(x, causal=True),
                    torch.softmax(x.masked_fill(~torch.ones(8, 16).bool().tril(), -torch.inf), -1),
                ),
                "attention": (
                    K.attention(x, x, x, causal=True),
                    F.scaled_dot_product_attention(x, x, x, is_causal=True),
                ),
                "matmul": (K.matmul(x[0, 0], w[:, None]), x[0, 0] @ w[:, None]),
                "naive_matmul": (K.naive_matmul(x[0, 0], w[:, None]), x[0, 0] @ w[:, None]),
                "add3": (K.add3(x, x, x), 3 * x),
            }
    for name, (got, want) in outs.items():
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=name)
    messages = [str(c.message) for c in caught if "llmlab.kernels" in str(c.message)]
    assert sorted(m.split(":")[0] for m in messages) == sorted(f"llmlab.kernels.{n}" for n in outs)
    # Autograd flows through the fallback too.
    K.layer_norm(x, w, b).sum().backward()
    assert x.grad is not None


@needs_no_interpreter
def test_gpt_with_triton_kernels_trains_on_cpu_via_fallback():
    from llmlab.models import GPT, GPTConfig

    common = {"vocab_size": 32, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 16}
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**common, kernels="torch"))
    fused = GPT(GPTConfig(**common, kernels="triton"))
    fused.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 32, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        torch.testing.assert_close(fused(ids), ref(ids), atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: K.matmul(torch.ones(3, 4), torch.ones(5, 2)), r"a.shape\[1\]=4 must equal"),
        (lambda: K.matmul(torch.ones(3, 4), torch.ones(4, 2), activation="tanh"), "'tanh'"),
        (lambda: K.matmul(torch.ones(3, 4), torch.ones(4, 2), block_m=24), "block_m=24"),
        (lambda: K.matmul(torch.ones(3, 4, dtype=torch.int32), torch.ones(4, 2)), "int32"),
        (lambda: K.naive_matmul(torch.ones(3, 4), torch.ones(5, 2)), r"a.shape\[1\]=4"),
        (lambda: K.naive_matmul(torch.ones(3, 4), torch.ones(4, 2), block_k=3), "block_k=3"),
        (lambda: K.layer_norm(torch.ones(2, 8), torch.ones(7), None), r"shape \(8,\)"),
        (lambda: K.layer_norm(torch.ones(2, 8), None, None, eps=0.0), "eps must be > 0"),
        (lambda: K.attention(torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.ones(2, 3, 4)), "4-D"),
        (lambda: K.attention(*(torch.ones(1, 2, 3, 4),) * 2, torch.ones(1, 2, 5, 4)), "must match"),
        (lambda: K.bias_gelu(torch.ones(2, 8), torch.ones(3)), r"\(3,\)"),
        (lambda: K.softmax(torch.ones(5), causal=True), "causal=True needs"),
        (lambda: K.add3(torch.ones(2), torch.ones(3), torch.ones(2)), "same shape"),
        (lambda: K.spmv(K.CSRMatrix.from_dense(torch.eye(3)), torch.ones(4)), r"\(3,\)"),
    ],
)
def test_bad_input_fails_early_with_the_value(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


# ------------------------------------------------------------------------- sparse formats
def test_formats_round_trip_and_agree_with_torch_sparse():
    torch.manual_seed(0)
    dense = torch.randn(9, 13) * (torch.rand(9, 13) < 0.3)
    dense[4] = 0.0
    csr = K.CSRMatrix.from_dense(dense)
    # Same compressed layout as torch's own CSR conversion (an oracle nobody here wrote).
    t = dense.to_sparse_csr()
    assert torch.equal(csr.crow.long(), t.crow_indices())
    assert torch.equal(csr.col.long(), t.col_indices())
    assert torch.equal(csr.val, t.values())
    assert torch.equal(csr.to_dense(), dense)
    assert torch.equal(csr.to_torch().to_dense(), dense)
    for source in (dense, dense.to_sparse(), t):
        ell = (
            K.ELLMatrix.from_torch(source)
            if source.is_sparse or source.is_sparse_csr
            else (K.ELLMatrix.from_dense(source))
        )
        assert ell.width == int((dense != 0).sum(1).max())
        assert torch.equal(ell.to_dense(), dense)
    assert torch.equal(K.ELLMatrix.from_csr(csr).to_dense(), dense)


@needs_no_interpreter
def test_sparse_references_match_dense_matmul():
    torch.manual_seed(1)
    dense = torch.randn(12, 20) * (torch.rand(12, 20) < 0.25)
    x, X = torch.randn(20), torch.randn(20, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for fmt in (K.CSRMatrix, K.ELLMatrix):
            a = fmt.from_dense(dense)
            torch.testing.assert_close(K.spmv(a, x), dense @ x, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(K.spmm(a, X), dense @ X, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-CUDA path")
def test_benchmark_without_cuda_says_so_and_exits_0(tmp_path, monkeypatch, capsys):
    import benchmarks.common as common
    from benchmarks import kernels as bench

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert bench.main([]) == 0
    assert "kernels: skipped: no CUDA" in capsys.readouterr().out
