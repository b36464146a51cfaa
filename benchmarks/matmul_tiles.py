"""The seed's tiled-matmul chapter, measured: naive vs tiled, and a sweep of tile sizes.

Run: ``python -m benchmarks.matmul_tiles`` on a CUDA machine. Rows, all in TFLOP/s (bf16):

* ``tiled vs naive``: ``llmlab.kernels.matmul`` (autotuned) against
  ``llmlab.kernels.naive_matmul`` (one program per output element, a loop over K), and against
  cuBLAS.
* one row per tile shape of ``llmlab.kernels.matmul.TILE_SWEEP`` (BLOCK_M, BLOCK_N, BLOCK_K,
  stages, warps) against cuBLAS, with what the compiled kernel really uses (shared memory
  bytes, registers per thread, spills) beside the model of ``tile_costs``. A shape that does
  not fit the GPU (Triton's ``OutOfResources``) is listed in the notes with the limit it hit.

Every result is checked against ``torch.matmul`` before it is timed. Without CUDA it prints
"skipped: no CUDA" and exits 0. ``--smoke`` runs every case at tiny sizes through the Triton
interpreter on the CPU (it sets ``TRITON_INTERPRET=1`` itself), wall-clock timed: it checks the
script, its numbers mean nothing. kernels/README.md ("Tiled matmul") explains the sweep.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.common import Row, parse_args, report

NAME = "matmul_tiles"


def launch_config(
    a: torch.Tensor, b: torch.Tensor, config: tuple[int, int, int, int, int]
) -> tuple[torch.Tensor, Any]:
    """``a @ b`` by the tiled kernel with one explicit (BM, BN, BK, stages, warps); returns the
    result and Triton's compiled-kernel handle (None under the interpreter)."""
    import triton

    from llmlab.kernels._runtime import jit_module
    from llmlab.kernels.matmul import launch_arguments

    bm, bn, bk, stages, warps = config
    c, args, flags = launch_arguments(a, b)
    grid = (triton.cdiv(a.shape[0], bm) * triton.cdiv(b.shape[1], bn),)
    kernel = jit_module("matmul").matmul_kernel[grid](
        *args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return c, kernel


def compiled_resources(kernel: Any) -> dict[str, int]:
    """Shared memory bytes, registers per thread and spilled registers of a compiled kernel."""
    if kernel is None:
        return {}
    found = {
        "shared_bytes": getattr(getattr(kernel, "metadata", None), "shared", None),
        "registers": getattr(kernel, "n_regs", None),
        "spills": getattr(kernel, "n_spills", None),
    }
    return {k: int(v) for k, v in found.items() if isinstance(v, int)}


def sweep_table() -> str:
    """kernels/README.md's tile-sweep table: ``tile_costs`` of every swept shape, for bf16 inputs
    (exact arithmetic; tests/kernels/test_matmul_tiles.py keeps the README equal to it)."""
    from llmlab.kernels.matmul import TILE_SWEEP, tile_costs

    lines = [
        "| BM×BN×BK | stages, warps | bytes per stage | shared memory | programs per SM by "
        "shared memory, A100 / H100 | accumulator registers per thread | programs per SM by "
        "registers | flops per byte loaded | interpreter | GPU time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config in TILE_SWEEP:
        bm, bn, bk, stages, warps = config
        c = tile_costs(*config, dtype_bytes=2)
        lines.append(
            f"| {bm}×{bn}×{bk} | {stages}, {warps} | {c['stage_bytes'] // 1024} KiB | "
            f"{c['smem_bytes'] // 1024} KiB | {c['programs_per_sm_smem_A100']} / "
            f"{c['programs_per_sm_smem_H100']} | {c['acc_regs_per_thread']:g} | "
            f"{c['programs_per_sm_regs']} | {c['flops_per_byte']:.1f} | matches torch | "
            "not measured here (no GPU) |"
        )
    return "\n".join(lines)


def _check(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """bf16 output of a K-long fp32-accumulated sum: 2 bf16 ulp, scaled by sqrt(K / 64)."""
    want = (a.double() @ b.double()).to(out.dtype)
    tol = 1.6e-2 * max(1.0, (a.shape[1] / 64) ** 0.5)
    torch.testing.assert_close(out, want, atol=tol, rtol=tol, msg=what)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = parse_args(parser, argv)
    from benchmarks.kernels import Bench, can_run_kernels, compare

    if not can_run_kernels(NAME, args.smoke):
        return 0
    import llmlab.kernels as K
    from llmlab.kernels.matmul import TILE_SWEEP, tile_costs

    torch.manual_seed(0)
    bench = Bench(args.smoke)
    dt = torch.float32 if args.smoke else torch.bfloat16
    rows: list[Row] = []
    notes = []

    # Naive vs tiled at one size (the naive kernel is slow: 2048^3 keeps it to well under 1 s).
    n = 24 if args.smoke else 2048
    a = torch.randn(n, n, device=bench.device, dtype=dt)
    b = torch.randn(n, n, device=bench.device, dtype=dt)
    if not args.smoke:  # bf16 checks; the smoke run's fp32 is checked by the interpreter tests
        _check(K.matmul(a, b), a, b, "tiled")
        _check(K.naive_matmul(a, b), a, b, "naive")
    refs = {
        "naive_matmul (one program per element)": bench.ms(lambda: K.naive_matmul(a, b)),
        "cuBLAS": bench.ms(lambda: torch.matmul(a, b)),
    }
    tiled = bench.ms(lambda: K.matmul(a, b))
    compare(rows, f"tiled matmul (autotuned) {n}^3", "TFLOP/s", 1e12, 2 * n**3, tiled, refs)

    # The sweep, at a size where every tile shape has thousands of tiles to spread over the SMs.
    n = 40 if args.smoke else 4096
    a = torch.randn(n, n, device=bench.device, dtype=dt)
    b = torch.randn(n, n, device=bench.device, dtype=dt)
    cublas = {"cuBLAS": bench.ms(lambda: torch.matmul(a, b))}
    for config in TILE_SWEEP:
        label = "BM{} BN{} BK{} s{} w{}".format(*config)
        try:
            out, kernel = launch_config(a, b, config)
        except Exception as err:  # triton.runtime.errors.OutOfResources on a GPU
            if type(err).__name__ != "OutOfResources":
                raise
            notes.append(f"{label}: does not fit ({err})")
            continue
        if not args.smoke:
            _check(out, a, b, label)
        ms = bench.ms(lambda c=config: launch_config(a, b, c))
        compare(rows, f"{label} {n}^3", "TFLOP/s", 1e12, 2 * n**3, ms, cublas)
        rows[-1].extra.update(tile_costs(*config, dtype_bytes=a.element_size()))
        rows[-1].extra.update(compiled_resources(kernel))
        used = compiled_resources(kernel)
        if used:
            notes.append(
                f"{label}: {used.get('shared_bytes', '?')} B shared, "
                f"{used.get('registers', '?')} registers/thread, {used.get('spills', '?')} spills"
            )
    device = "CPU (Triton interpreter, smoke run)" if args.smoke else torch.cuda.get_device_name()
    report(NAME, rows, notes=f"device: {device}; {dt} inputs. " + "; ".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
