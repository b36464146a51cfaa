"""Pipeline schedules, measured: bubble fraction vs theory, and 1F1B's activation memory vs GPipe's.

Each stage is a layer that sleeps a fixed time in forward and in backward (and multiplies by a
weight, so autograd saves its input: one activation per micro-batch). Sleeping takes no CPU, so
the timeline is the schedule's and not this shared machine's load. Every rank records when each
instruction starts and ends; the measured bubble is ``1 - Σ compute / (p · makespan)``, compared
with the theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) for interleaved (v = 2, each
chunk sleeping half as long), (p-1)/p for naive. Stages sleep STEP_S (naive: NAIVE_STEP_S) so
that each message's and instruction's cost on this loaded machine (~0.3-2 ms, which the formulas
count as zero) stays well under 10% of the smallest bubbles. Activation memory is what autograd
keeps alive for backward (bytes), measured with saved-tensor hooks; 1F1B's peak must be ≤ p/m of
GPipe's.

Each engine first runs one untimed warm-up step with the sleeps set to zero: it exchanges the
activation-shape headers (once per engine, not per step) and takes Python's and torch's
first-call costs, so the timed step is a steady-state step, which is what the formula describes.
The timed step is the second step of the same engine, measured in full.

    .venv/bin/python -m benchmarks.pipeline        # writes benchmarks/results/pipeline.json

``--smoke``: p = 2, m = 2 and 4, 10 ms stages (its bubbles are not expected to match theory).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import Tensor, nn

from benchmarks.common import Row, parse_args, report, results_dir
from llmlab.parallel.pipeline.engine import PipelineEngine
from llmlab.parallel.pipeline.schedules import theoretical_bubble
from llmlab.parallel.pipeline.timeline import gather_events, measured_bubble, plot_timeline

# Forward (and backward) time of one whole stage: long against the ~0.3-2 ms that each message
# and instruction costs on a loaded 2-core machine, which the formulas count as zero. The small
# bubbles (interleaved p=2 m=16: 0.030) leave ~20 ms of slack for a whole step at 10%.
STEP_S = 0.4
# Naive's bubble, (p-1)/p, does not shrink with m: a millisecond is ~1e-3 of its idle time even at
# 100 ms stages, so it runs shorter stages and leaves the time budget to the other schedules.
NAIVE_STEP_S = 0.1
WIDTH = 4096  # activation elements per sample
MICROBATCHES = (1, 2, 4, 8, 16)
TIMELINE_M = 8  # draw the Gantt chart of these runs


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, forward_s: float, backward_s: float) -> Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepStage(nn.Module):
    """A stage with a fixed compute time; ``x * weight`` makes autograd save ``x``."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: Tensor) -> Tensor:
        return _Sleep.apply(x * self.weight, self.forward_s, self.backward_s)


SMOKE_MICROBATCHES, SMOKE_STEP_S = (2, 4), 0.01


def cases(p: int, microbatches: tuple[int, ...] = MICROBATCHES) -> list[tuple[str, int, int]]:
    out = [(s, m, 1) for s in ("naive", "gpipe", "1f1b") for m in microbatches]
    out += [("interleaved", m, 2) for m in microbatches if m % p == 0]
    return out


def _rank(rank: int, world: int, smoke: bool = False) -> list[dict]:
    results = []
    microbatches = SMOKE_MICROBATCHES if smoke else MICROBATCHES
    timeline_m = microbatches[-1] if smoke else TIMELINE_M
    for name, m, v in cases(world, microbatches):
        step_s = SMOKE_STEP_S if smoke else NAIVE_STEP_S if name == "naive" else STEP_S
        chunks = [SleepStage(step_s / v, step_s / v) for _ in range(v)]
        engine = PipelineEngine(
            chunks,
            rank,
            world,
            loss_fn=lambda out, target: out.sum(),
            record_timeline=True,
            measure_memory=True,
        )
        x = torch.ones(m, WIDTH)
        for chunk in chunks:  # warm-up: shape headers and first calls, no sleeping
            chunk.forward_s = chunk.backward_s = 0.0
        engine.train_step(x, x, m, name)
        for chunk in chunks:
            chunk.forward_s = chunk.backward_s = step_s / v
        result = engine.train_step(x, x, m, name)
        events = gather_events(result.events)
        peaks = [None] * world
        torch.distributed.all_gather_object(peaks, result.peak_activation_bytes)
        if rank == 0:
            bubble = measured_bubble(events, world)
            if m == timeline_m:
                plot_timeline(
                    events,
                    world,
                    results_dir() / f"pipeline_timeline_{name}_p{world}_m{m}.png",
                    title=f"{name} p={world} m={m}" + (f" v={v}" if v > 1 else ""),
                )
            results.append(
                {
                    "schedule": name,
                    "p": world,
                    "m": m,
                    "v": v,
                    "stage_s": step_s,
                    "bubble": bubble,
                    "peak_bytes": peaks,
                }
            )
    return results


def main(argv: list[str] | None = None) -> None:
    from llmlab.parallel.launch import run_distributed

    args = parse_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]), argv)
    microbatches = SMOKE_MICROBATCHES if args.smoke else MICROBATCHES
    rows: list[Row] = []
    misses: list[str] = []
    started = time.perf_counter()
    for p in (2,) if args.smoke else (2, 4):
        measured = run_distributed(_rank, p, args.smoke, timeout=600)[0]
        by_key = {(r["schedule"], r["m"]): r for r in measured}
        for r in measured:
            theory = theoretical_bubble(r["schedule"], p, r["m"], r["v"])
            rel = abs(r["bubble"] - theory) / theory if theory else abs(r["bubble"])
            ok = rel <= 0.10
            if not ok:
                misses.append(
                    f"{r['schedule']} p={p} m={r['m']}: {r['bubble']:.4f} vs {theory:.4f}"
                )
            rows.append(
                Row(
                    name=f"bubble {r['schedule']} p={p} m={r['m']}",
                    llmlab=r["bubble"],
                    reference=theory,
                    reference_name="theory",
                    unit="idle fraction",
                    higher_is_better=False,
                    extra={"relative_error": rel, "within_10pct": ok, "stage_s": r["stage_s"]},
                )
            )
        for m in microbatches:
            gpipe, one_f = by_key[("gpipe", m)]["peak_bytes"], by_key[("1f1b", m)]["peak_bytes"]
            worst = max(o / g for o, g in zip(one_f, gpipe))
            ok = worst <= p / m + 1e-9
            if not ok:
                misses.append(f"1f1b memory p={p} m={m}: {worst:.3f} of gpipe > p/m")
            rows.append(
                Row(
                    name=f"peak activations 1f1b/gpipe p={p} m={m}",
                    llmlab=max(one_f),
                    reference=max(gpipe),
                    reference_name="gpipe",
                    unit="bytes",
                    higher_is_better=False,
                    target=m / p,  # 1f1b <= p/m of gpipe  <=>  gpipe / 1f1b >= m/p
                    extra={"per_stage_1f1b": one_f, "per_stage_gpipe": gpipe, "worst": worst},
                )
            )
    elapsed = time.perf_counter() - started
    notes = (
        f"stage time {STEP_S * 1000:.0f} ms forward and backward (naive: "
        f"{NAIVE_STEP_S * 1000:.0f} ms), after a zero-sleep warm-up step; "
        "ratio = theory / measured "
        f"for bubbles (1.0 is exact), gpipe / 1f1b for memory; {elapsed:.0f} s.\n"
        f"timelines: {results_dir()}/pipeline_timeline_<schedule>_p<p>_m{TIMELINE_M}.png\n"
        + (
            "all bubbles within 10% of theory, 1f1b memory <= p/m of gpipe"
            if not misses
            else "MISSES: " + "; ".join(misses)
        )
    )
    report("pipeline", rows, notes)


if __name__ == "__main__":
    main()
