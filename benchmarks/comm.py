"""Collectives on gloo/localhost: measured time vs the α-β prediction, and bus bandwidth.

Fits α (latency) and β (inverse bandwidth) from a point-to-point ping-pong on this machine, then
times our three all-reduce algorithms and ``torch.distributed.all_reduce`` at 1 KB..64 MB on
2 ranks. Rows compare each of our algorithms with torch's (ratio > 1: ours is faster).

    .venv/bin/python -m benchmarks.comm [--smoke]     # smoke: 1 and 4 KiB, one timing each
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from benchmarks.common import Row, parse_args, report
from llmlab.parallel.comm import all_reduce, bus_bandwidth, fit_alpha_beta, predicted_time
from llmlab.parallel.launch import run_distributed

WORLD = 2
SIZES = [1 << k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB, ×4 each
ALGORITHMS = ["ring", "recursive_doubling", "reduce_broadcast"]


def _repeats(nbytes: int, smoke: bool = False) -> int:
    if smoke:
        return 1
    return 30 if nbytes <= 1 << 16 else 10 if nbytes <= 1 << 22 else 3


def _timed(fn, repeats: int) -> float:
    """Best of ``repeats``; ranks line up on a barrier before each try, the slowest rank counts."""
    fn()  # warm-up (connections, allocator)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        best = min(best, elapsed.item())
    return best


def measure(rank: int, world: int, sizes: list[int], smoke: bool = False) -> dict:
    out: dict = {"pingpong": {}, "allreduce": {}}
    for nbytes in sizes:  # one-way time = round trip / 2
        buf = torch.zeros(nbytes // 4)

        def pingpong(buf=buf):
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        out["pingpong"][nbytes] = _timed(pingpong, _repeats(nbytes, smoke)) / 2
        for algo in [*ALGORITHMS, "torch"]:
            x = torch.randn(nbytes // 4)
            if algo == "torch":
                fn = lambda x=x: dist.all_reduce(x)  # noqa: E731
            else:
                fn = lambda x=x, a=algo: all_reduce(x, algorithm=a)  # noqa: E731
            out["allreduce"][(algo, nbytes)] = _timed(fn, _repeats(nbytes, smoke))
    return out


def _fmt_bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]), argv)
    sizes = SIZES[:2] if args.smoke else SIZES
    torch.set_num_threads(1)
    res = run_distributed(measure, WORLD, sizes, args.smoke, timeout=600)[0]
    sizes = sorted(res["pingpong"])
    alpha, beta = fit_alpha_beta([float(s) for s in sizes], [res["pingpong"][s] for s in sizes])
    print(
        f"fitted on {WORLD}-rank ping-pong: alpha = {alpha * 1e6:.1f} us, "
        f"beta = {beta * 1e9:.3f} ns/byte ({1 / beta / 1e9:.2f} GB/s)"
    )
    header = (
        f"{'algorithm':<20} {'size':>8} {'measured ms':>12} {'alpha-beta ms':>14} "
        f"{'busbw GB/s':>11}"
    )
    print(header)
    print("-" * len(header))
    rows: list[Row] = []
    for algo in [*ALGORITHMS, "torch"]:
        model = "ring" if algo == "torch" else algo  # gloo's algorithm is predicted as a ring
        for nbytes in sizes:
            t = res["allreduce"][(algo, nbytes)]
            pred = predicted_time(model, nbytes, WORLD, alpha, beta)
            bw = bus_bandwidth("ring", nbytes, WORLD, t)
            print(
                f"{algo:<20} {_fmt_bytes(nbytes):>8} {t * 1e3:>12.3f} {pred * 1e3:>14.3f} "
                f"{bw / 1e9:>11.3f}"
            )
            if algo != "torch":
                rows.append(
                    Row(
                        name=f"all-reduce {algo} {_fmt_bytes(nbytes)}",
                        llmlab=t,
                        reference=res["allreduce"][("torch", nbytes)],
                        reference_name="torch.distributed.all_reduce (gloo)",
                        unit="s",
                        higher_is_better=False,
                        extra={"predicted_s": pred, "busbw_GBps": bw / 1e9, "nbytes": nbytes},
                    )
                )
    notes = (
        f"world={WORLD} gloo/localhost; alpha={alpha:.3e} s, beta={beta:.3e} s/byte "
        "(relative-error weighted least squares on one-way ping-pong times, 1 KiB-64 MiB); "
        "predictions: ring 2(p-1)a + 2(p-1)/p n b, recursive doubling log2(p)(a + n b), "
        "reduce+broadcast 2 ceil(log2 p)(a + n b); torch predicted as a ring."
    )
    report("comm", rows, notes)


if __name__ == "__main__":
    main()
