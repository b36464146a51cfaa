"""Benchmark llmlab.kernels against PyTorch eager, torch.compile, cuBLAS (matmul) and SDPA.

Run: ``python -m benchmarks.kernels`` on a CUDA machine. Each row is an achieved rate
(TFLOP/s for matmul and attention, GB/s of compulsory memory traffic for the memory-bound
fusions, GFLOP/s for sparse) for llmlab and for a reference measured in the same run; the ratio
is llmlab / reference (> 1: llmlab is faster). Targets from the issue (H100/H200-class GPU):
matmul >= 0.9x cuBLAS at 4096^3 bf16, fused ops >= 1.5x eager, attention >= 0.8x SDPA.

Without CUDA it prints "skipped: no CUDA" and exits 0. ``--smoke`` runs every case at tiny
sizes on the CPU through the Triton interpreter (it sets ``TRITON_INTERPRET=1`` itself) with
wall-clock timing and without torch.compile, to check the script itself; its numbers mean
nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import Row, best_of, parse_args, report

NAME = "kernels"


class Bench:
    """Times callables: ``triton.testing.do_bench`` (median ms) on CUDA, wall clock if smoke."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"

    def ms(self, fn: Callable[[], object]) -> float:
        if self.smoke:
            return 1e3 * best_of(fn, repeats=1, warmup=1)
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    def compiled(self, fn: Callable) -> Callable | None:
        """``torch.compile(fn)``; None in smoke runs (compiling on CPU takes minutes here)."""
        return None if self.smoke else torch.compile(fn)


def rate(amount: float, ms: float) -> float:
    """``amount`` per second, in units of 1e12 (TFLOP/s) or 1e9 (GB/s) chosen by the caller."""
    return amount / (ms * 1e-3)


def compare(rows, name, unit, scale, amount, ours, refs, target_ref=None, target=None):
    """Append one Row per reference: llmlab's rate vs that reference's rate."""
    ours_rate = rate(amount, ours) / scale
    for ref_name, ref_ms in refs.items():
        if ref_ms is None:
            continue
        rows.append(
            Row(
                name=name,
                llmlab=ours_rate,
                reference=rate(amount, ref_ms) / scale,
                reference_name=ref_name,
                unit=unit,
                target=target if ref_name == target_ref else None,
                extra={"llmlab_ms": ours, "reference_ms": ref_ms},
            )
        )


def bench_matmul(b: Bench, rows: list[Row], smoke: bool) -> None:

    sizes = [(32, 32, 32)] if smoke else [(4096, 4096, 4096), (8192, 8192, 8192)]
    for M, N, Kd in sizes:
        _matmul_case(b, rows, M, N, Kd)


def _matmul_case(b: Bench, rows: list[Row], M: int, N: int, Kd: int) -> None:
    import llmlab.kernels as K

    a = torch.randn(M, Kd, device=b.device, dtype=torch.bfloat16)
    w = torch.randn(Kd, N, device=b.device, dtype=torch.bfloat16)
    bias = torch.randn(N, device=b.device, dtype=torch.bfloat16)
    flops = 2 * M * N * Kd
    compiled = b.compiled(lambda x, y: x @ y)
    refs = {"cuBLAS": b.ms(lambda: torch.matmul(a, w))}
    if compiled is not None:
        refs["torch.compile"] = b.ms(lambda: compiled(a, w))
    ours = b.ms(lambda: K.matmul(a, w))
    compare(rows, f"matmul {M}x{N}x{Kd} bf16", "TFLOP/s", 1e12, flops, ours, refs, "cuBLAS", 0.9)

    # Fused epilogue vs cuBLAS + separate bias-GELU kernels.
    def eager_epilogue():
        return F.gelu(torch.matmul(a, w) + bias, approximate="tanh")

    compiled_epi = b.compiled(eager_epilogue)
    refs = {"eager": b.ms(eager_epilogue)}
    if compiled_epi is not None:
        refs["torch.compile"] = b.ms(compiled_epi)
    ours = b.ms(lambda: K.matmul(a, w, bias, "gelu"))
    compare(rows, f"matmul+bias+gelu {M}x{N}x{Kd} bf16", "TFLOP/s", 1e12, flops, ours, refs)


def _fwd_bwd(fn: Callable, inputs: list[torch.Tensor]) -> Callable[[], None]:
    out = fn(*inputs)
    dy = torch.randn_like(out)

    def step() -> None:
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(dy)

    return step


def bench_fusions(b: Bench, rows: list[Row], smoke: bool) -> None:
    import llmlab.kernels as K

    R, C = (4, 48) if smoke else (16384, 4096)
    dt = torch.float32 if smoke else torch.bfloat16
    es = torch.tensor([], dtype=dt).element_size()
    n = R * C

    def leaf(*shape):
        return torch.randn(*shape, device=b.device, dtype=dt, requires_grad=True)

    x, r, w, bias = leaf(R, C), leaf(R, C), leaf(C), leaf(C)

    def causal(t):
        mask = torch.ones(t.shape[-2:], dtype=torch.bool, device=t.device).tril()
        return torch.softmax(t.masked_fill(~mask, float("-inf")), dim=-1)

    def add_ln(x, r, w, bias):
        return F.layer_norm(x + r, (C,), w, bias)

    def bias_gelu(x, bias):
        return F.gelu(x + bias, approximate="tanh")

    def rms_norm(x, w):  # HF LlamaRMSNorm
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def swiglu(a, c):
        return F.silu(a) * c

    # (name, llmlab fn, eager fn, inputs, forward bytes, forward+backward bytes)
    cases = [
        ("bias+gelu", K.bias_gelu, bias_gelu, [x, bias], 2 * n * es, 5 * n * es),
        (
            "residual+layernorm",
            lambda *a: K.add_layer_norm(*a)[0],
            add_ln,
            [x, r, w, bias],
            4 * n * es,
            8 * n * es,
        ),
        ("rmsnorm", lambda x, w: K.rms_norm(x, w, 1e-6), rms_norm, [x, w], 2 * n * es, 5 * n * es),
        # forward: read a, b, write y; backward: read dy, a, b, write da, db
        ("swiglu", K.swiglu, swiglu, [x, r], 3 * n * es, 8 * n * es),
        (
            "softmax causal",
            lambda t: K.softmax(t, causal=True),
            causal,
            [x],
            2 * n * es,
            5 * n * es,
        ),
    ]
    for name, ours_fn, eager_fn, inputs, fwd_bytes, both_bytes in cases:
        compiled = b.compiled(eager_fn)
        with torch.no_grad():
            refs = {"eager": b.ms(lambda f=eager_fn, i=inputs: f(*i))}
            if compiled is not None:
                refs["torch.compile"] = b.ms(lambda f=compiled, i=inputs: f(*i))
            ours = b.ms(lambda f=ours_fn, i=inputs: f(*i))
        compare(rows, f"{name} fwd {R}x{C}", "GB/s", 1e9, fwd_bytes, ours, refs, "eager", 1.5)
        refs = {"eager": b.ms(_fwd_bwd(eager_fn, inputs))}
        if compiled is not None:
            refs["torch.compile"] = b.ms(_fwd_bwd(compiled, inputs))
        ours = b.ms(_fwd_bwd(ours_fn, inputs))
        compare(rows, f"{name} fwd+bwd {R}x{C}", "GB/s", 1e9, both_bytes, ours, refs, "eager", 1.5)

    a, c, d = (torch.randn(n, device=b.device, dtype=dt) for _ in range(3))
    add3 = b.compiled(lambda a, c, d: a + c + d)
    refs = {"eager": b.ms(lambda: a + c + d)}
    if add3 is not None:
        refs["torch.compile"] = b.ms(lambda: add3(a, c, d))
    ours = b.ms(lambda: K.add3(a, c, d))
    # Compulsory traffic: 3 loads + 1 store (eager also moves the temporary: 4 loads, 2 stores).
    # "n=": a bare number in a case name reads as a rate to anyone parsing the printed table.
    compare(rows, f"a+b+c n={n}", "GB/s", 1e9, 4 * n * es, ours, refs, "eager", 1.5)


def bench_attention(b: Bench, rows: list[Row], smoke: bool) -> None:

    # (B, H, T, D, H_kv): the last is grouped-query (Llama-style, 4 query heads per KV head)
    shapes = (
        [(1, 1, 20, 16, 1), (1, 2, 20, 16, 1)]
        if smoke
        else [(4, 16, 2048, 64, 16), (2, 16, 4096, 128, 16), (4, 32, 2048, 128, 8)]
    )
    dt = torch.float32 if smoke else torch.bfloat16
    for B, H, T, D, H_kv in shapes:
        _attention_case(b, rows, B, H, T, D, dt, H_kv)


def _attention_case(
    b: Bench, rows: list[Row], B: int, H: int, T: int, D: int, dt, H_kv: int
) -> None:
    import llmlab.kernels as K

    q = torch.randn(B, H, T, D, device=b.device, dtype=dt, requires_grad=True)
    k, v = (
        torch.randn(B, H_kv, T, D, device=b.device, dtype=dt, requires_grad=True) for _ in range(2)
    )
    fwd_flops = 4 * B * H * T * T * D / 2  # causal: half the score matrix

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H_kv != H)

    def eager(q, k, v):
        k, v = k.repeat_interleave(H // H_kv, 1), v.repeat_interleave(H // H_kv, 1)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v

    def ours_fn(q, k, v):
        return K.attention(q, k, v, causal=True)

    compiled = b.compiled(eager)
    with torch.no_grad():
        refs = {"SDPA": b.ms(lambda: sdpa(q, k, v)), "eager": b.ms(lambda: eager(q, k, v))}
        if compiled is not None:
            refs["torch.compile"] = b.ms(lambda: compiled(q, k, v))
        ours = b.ms(lambda: ours_fn(q, k, v))
    label = f"attention causal B{B} H{H} T{T} D{D}" + (f" GQA kv{H_kv}" if H_kv != H else "")
    compare(rows, f"{label} fwd", "TFLOP/s", 1e12, fwd_flops, ours, refs, "SDPA", 0.8)
    refs = {"SDPA": b.ms(_fwd_bwd(sdpa, [q, k, v])), "eager": b.ms(_fwd_bwd(eager, [q, k, v]))}
    if compiled is not None:
        refs["torch.compile"] = b.ms(_fwd_bwd(compiled, [q, k, v]))
    ours = b.ms(_fwd_bwd(ours_fn, [q, k, v]))
    # Backward = 2.5x the forward's matmul flops (FlashAttention's convention).
    compare(rows, f"{label} fwd+bwd", "TFLOP/s", 1e12, 3.5 * fwd_flops, ours, refs, "SDPA", 0.8)


def bench_sparse(b: Bench, rows: list[Row], smoke: bool) -> None:
    import llmlab.kernels as K

    R, Kd, N, density = (20, 30, 8, 0.2) if smoke else (8192, 8192, 128, 0.01)
    dense = torch.randn(R, Kd, device=b.device) * (torch.rand(R, Kd, device=b.device) < density)
    X = torch.randn(Kd, N, device=b.device)
    x = X[:, 0].contiguous()
    csr_torch = dense.to_sparse_csr()
    nnz = csr_torch.values().numel()
    refs_mm = {"torch.sparse (CSR)": b.ms(lambda: torch.sparse.mm(csr_torch, X))}
    refs_mv = {"torch.sparse (CSR)": b.ms(lambda: torch.mv(csr_torch, x))}
    for fmt in (K.CSRMatrix, K.ELLMatrix):
        a = fmt.from_dense(dense)
        label = fmt.__name__.removesuffix("Matrix")
        compare(
            rows,
            f"SpMM {label} {R}x{Kd} d={density} N={N}",
            "GFLOP/s",
            1e9,
            2 * nnz * N,
            b.ms(lambda a=a: K.spmm(a, X)),
            refs_mm,
        )
        compare(
            rows,
            f"SpMV {label} {R}x{Kd} d={density}",
            "GFLOP/s",
            1e9,
            2 * nnz,
            b.ms(lambda a=a: K.spmv(a, x)),
            refs_mv,
        )


def bench_memory(b: Bench, rows: list[Row], smoke: bool) -> None:
    import llmlab.kernels as K

    M, N = (20, 30) if smoke else (8192, 8192)
    x = torch.randn(M, N, device=b.device)
    traffic = 2 * x.numel() * x.element_size()
    coalesced = b.ms(lambda: K.copy(x, coalesced=True))
    compare(
        rows,
        f"copy coalesced {M}x{N} fp32",
        "GB/s",
        1e9,
        traffic,
        coalesced,
        {"torch clone": b.ms(x.clone)},
    )
    compare(
        rows,
        f"copy strided {M}x{N} fp32",
        "GB/s",
        1e9,
        traffic,
        b.ms(lambda: K.copy(x, coalesced=False)),
        {"llmlab coalesced copy": coalesced},
    )
    tiled = b.ms(lambda: K.transpose(x, tiled=True))
    compare(
        rows,
        f"transpose tiled {M}x{N} fp32",
        "GB/s",
        1e9,
        traffic,
        tiled,
        {"torch .t().contiguous()": b.ms(lambda: x.t().contiguous())},
    )
    compare(
        rows,
        f"transpose naive {M}x{N} fp32",
        "GB/s",
        1e9,
        traffic,
        b.ms(lambda: K.transpose(x, tiled=False)),
        {"llmlab tiled transpose": tiled},
    )


def can_run_kernels(name: str, smoke: bool) -> bool:
    """Whether a kernel benchmark can run here; if not, its section is reported skipped. A
    smoke run sets the interpreter before any Triton kernel is defined (it then runs on CPU)."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    from llmlab.kernels import triton_available

    if not smoke and not torch.cuda.is_available():
        report(name, [], skipped="no CUDA")
        return False
    if not triton_available():
        report(name, [], skipped="triton is not installed")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = parse_args(parser, argv)
    if not can_run_kernels(NAME, args.smoke):
        return 0
    torch.manual_seed(0)
    b = Bench(args.smoke)
    rows: list[Row] = []
    for section in (bench_matmul, bench_fusions, bench_attention, bench_sparse, bench_memory):
        section(b, rows, args.smoke)
    device = "CPU (Triton interpreter, smoke run)" if args.smoke else torch.cuda.get_device_name()
    report(NAME, rows, notes=f"device: {device}; rates are achieved throughput, ratio = llmlab/ref")
    return 0


if __name__ == "__main__":
    sys.exit(main())
