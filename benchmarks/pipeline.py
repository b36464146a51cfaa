"""Pipeline schedules, measured: bubble fraction vs theory, and activation memory vs GPipe / 1F1B.

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

Split backward (ZB-H1, ZB-V, DualPipeV) runs on stages with calibrated F, B and W times
(:class:`CalibratedStage`: a forward sleep, a sleep on the input-gradient path, one on the
weight-gradient path, so the engine's B runs only the second and W only the third), all equal
(T_F = T_B = T_W), against 1F1B on the same stages (its whole backward takes B + W). A rank of
the V shapes holds two chunks of half a stage. The first stage's input requires a gradient so
its B is calibrated too (with token ids it would be empty and W the whole backward). Rows: each
bubble vs its formula (ZB-H1 (p−1)/(3m+p−1), ZB-V and DualPipeV (p−1)/(6m+p−1), 1F1B
(p−1)/(m+p−1)), ZB-H1's idle time against 1F1B's (theory: a third), and each schedule's peak
activation bytes on its worst rank against 1F1B's.

    .venv/bin/python -m benchmarks.pipeline        # writes benchmarks/results/pipeline.json
    .venv/bin/python -m benchmarks.pipeline --smoke   # seconds: tiny stages, p=2 only
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks.common import Row, parse_args, report, results_dir
from llmlab.parallel.pipeline.engine import PipelineEngine
from llmlab.parallel.pipeline.schedules import placement, theoretical_bubble
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
# Split backward: T_F = T_B = T_W = ZB_STAGE_S for a whole stage (a V chunk: half of each). One
# micro-batch count per p, the smallest at which every formula holds (ZB-V: m >= 3p/2, DualPipeV:
# m >= 2p), where the bubbles are largest against the per-instruction overheads.
ZB_STAGE_S = 0.4
ZB_MICROBATCHES = {2: 4, 4: 8}
ZB_SCHEDULES = ("1f1b", "zb1", "zbv", "dualpipev")
UNITS_PER_STAGE = 2  # a stage is two units; a V chunk is one (half a stage, half the memory)


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


class _SleepOnWeightPath(torch.autograd.Function):
    """Identity on a weight (a view: no activation memory); its backward sleeps, so only W,
    which walks the weight's branch of the graph, pays it."""

    @staticmethod
    def forward(ctx, weight: Tensor, backward_s: float) -> Tensor:
        ctx.backward_s = backward_s
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        time.sleep(ctx.backward_s)
        return grad, None


class SleepStage(nn.Module):
    """A stage with a fixed compute time; ``x * weight`` makes autograd save ``x``."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: Tensor) -> Tensor:
        return _Sleep.apply(x * self.weight, self.forward_s, self.backward_s)


class CalibratedStage(nn.Module):
    """``units`` layers, each ``x * weight`` (saving ``x`` until W) taking ``unit_s`` in F, in B
    (the input-gradient path) and in W (the weight-gradient path); a whole backward takes both."""

    def __init__(self, units: int, unit_s: float) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.ones(WIDTH)) for _ in range(units))
        self.unit_s = unit_s

    def forward(self, x: Tensor) -> Tensor:
        for w in self.weights:
            x = _Sleep.apply(x * _SleepOnWeightPath.apply(w, self.unit_s), self.unit_s, self.unit_s)
        return x


def cases(p: int, microbatches: tuple[int, ...] = MICROBATCHES) -> list[tuple[str, int, int]]:
    out = [(s, m, 1) for s in ("naive", "gpipe", "1f1b") for m in microbatches]
    out += [("interleaved", m, 2) for m in microbatches if m % p == 0]
    return out


def _set_sleep(chunks: list[nn.Module], seconds: float) -> None:
    for chunk in chunks:
        for attr in ("forward_s", "backward_s", "unit_s"):
            if hasattr(chunk, attr):
                setattr(chunk, attr, seconds)


def _timed_step(
    chunks: list[nn.Module], seconds: float, name: str, m: int, rank: int, world: int, x: Tensor
) -> tuple[list, list]:
    """One untimed zero-sleep step (shape headers, first calls), then the timed step: every
    rank's events and every rank's peak activation bytes."""
    engine = PipelineEngine(
        chunks,
        rank,
        world,
        loss_fn=lambda out, target: out.sum(),
        record_timeline=True,
        measure_memory=True,
    )
    _set_sleep(chunks, 0.0)
    engine.train_step(x, x, m, name)
    _set_sleep(chunks, seconds)
    result = engine.train_step(x, x, m, name)
    events = gather_events(result.events)
    peaks = [None] * world
    torch.distributed.all_gather_object(peaks, result.peak_activation_bytes)
    return events, peaks


def _rank(
    rank: int, world: int, scale: float, microbatches: tuple[int, ...], timelines: str
) -> list[dict]:
    results = []
    for name, m, v in cases(world, microbatches):
        step_s = (NAIVE_STEP_S if name == "naive" else STEP_S) * scale
        chunks = [SleepStage(step_s / v, step_s / v) for _ in range(v)]
        events, peaks = _timed_step(chunks, step_s / v, name, m, rank, world, torch.ones(m, WIDTH))
        if rank == 0:
            if m == TIMELINE_M:
                plot_timeline(
                    events,
                    world,
                    Path(timelines) / f"pipeline_timeline_{name}_p{world}_m{m}.png",
                    title=f"{name} p={world} m={m}" + (f" v={v}" if v > 1 else ""),
                )
            results.append(_record(name, world, m, v, step_s, events, peaks))
    return results + _split_backward_rank(rank, world, scale, timelines)


def _record(name: str, p: int, m: int, v: int, stage_s: float, events, peaks) -> dict:
    compute = sum(e.end - e.start for e in events if e.op in ("forward", "backward"))
    compute += sum(e.end - e.start for e in events if e.op.startswith("backward_"))
    span = max(e.end for e in events) - min(e.start for e in events)
    return {
        "schedule": name,
        "p": p,
        "m": m,
        "v": v,
        "stage_s": stage_s,
        "bubble": measured_bubble(events, p),
        "idle_s": span - compute / p,  # idle time per rank
        "peak_bytes": peaks,
    }


def _split_backward_rank(rank: int, world: int, scale: float, timelines: str) -> list[dict]:
    """1F1B, ZB-H1, ZB-V and DualPipeV on calibrated stages of equal F, B and W times."""
    results = []
    m = ZB_MICROBATCHES[world]
    unit_s = ZB_STAGE_S * scale / UNITS_PER_STAGE
    for name in ZB_SCHEDULES:
        v = 2 if placement(name) == "v" else 1
        chunks = [CalibratedStage(UNITS_PER_STAGE // v, unit_s) for _ in range(v)]
        x = torch.ones(m, WIDTH, requires_grad=True)  # so the first stage's B has work too
        events, peaks = _timed_step(chunks, unit_s, name, m, rank, world, x)
        if rank == 0:
            plot_timeline(
                events,
                world,
                Path(timelines) / f"pipeline_timeline_{name}_calibrated_p{world}_m{m}.png",
                title=f"{name} p={world} m={m}, T_F = T_B = T_W",
            )
            record = _record(name, world, m, v, ZB_STAGE_S * scale, events, peaks)
            results.append({**record, "calibrated": True})
    return results


def _classic_rows(
    p: int, measured: list[dict], microbatches: tuple[int, ...], misses: list[str]
) -> list[Row]:
    rows: list[Row] = []
    by_key = {(r["schedule"], r["m"]): r for r in measured if not r.get("calibrated")}
    for r in measured:
        if r.get("calibrated"):
            continue
        rows.append(_bubble_row(r, p, misses))
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
    return rows


def _bubble_row(r: dict, p: int, misses: list[str], label: str = "") -> Row:
    theory = theoretical_bubble(r["schedule"], p, r["m"], r["v"])
    rel = abs(r["bubble"] - theory) / theory if theory else abs(r["bubble"])
    ok = rel <= 0.10
    name = f"bubble {r['schedule']}{label} p={p} m={r['m']}"
    if not ok:
        misses.append(f"{name}: {r['bubble']:.4f} vs {theory:.4f}")
    return Row(
        name=name,
        llmlab=r["bubble"],
        reference=theory,
        reference_name="theory",
        unit="idle fraction",
        higher_is_better=False,
        extra={"relative_error": rel, "within_10pct": ok, "stage_s": r["stage_s"]},
    )


def _split_rows(p: int, measured: list[dict], misses: list[str]) -> list[Row]:
    runs = {r["schedule"]: r for r in measured if r.get("calibrated")}
    rows = [_bubble_row(runs[name], p, misses, " (T_F=T_B=T_W)") for name in ZB_SCHEDULES]
    one, zb1 = runs["1f1b"], runs["zb1"]
    ratio = one["idle_s"] / zb1["idle_s"]
    if abs(ratio - 3) > 0.3:
        misses.append(f"zb1 idle p={p}: 1/{ratio:.2f} of 1f1b's, theory 1/3")
    rows.append(
        Row(
            name=f"idle time per rank zb1 vs 1f1b p={p} m={one['m']}",
            llmlab=zb1["idle_s"],
            reference=one["idle_s"],
            reference_name="1f1b",
            unit="s",
            higher_is_better=False,
            target=2.7,  # theory: 3 (a third of 1F1B's idle time), within 10%
        )
    )
    worst_1f1b = max(one["peak_bytes"])
    for name in ZB_SCHEDULES[1:]:
        peaks = runs[name]["peak_bytes"]
        rows.append(
            Row(
                name=f"peak activations {name} vs 1f1b p={p} m={one['m']} (worst rank)",
                llmlab=max(peaks),
                reference=worst_1f1b,
                reference_name="1f1b",
                unit="bytes",
                higher_is_better=False,
                # ZB-H1 and ZB-V keep 1F1B's worst-rank memory; DualPipeV half a stage more
                target=1.0 if name != "dualpipev" else None,
                extra={"per_rank": peaks, "per_rank_1f1b": one["peak_bytes"]},
            )
        )
    return rows


def main() -> None:
    from llmlab.parallel.launch import run_distributed

    # --smoke: seconds, 2 ranks, 1/100 of the stage times; its results and charts go to the
    # scratch directory of benchmarks.common, never over the real run's
    args = parse_args(argparse.ArgumentParser(prog="python -m benchmarks.pipeline"))
    scale = 0.01 if args.smoke else 1.0
    microbatches = (4,) if args.smoke else MICROBATCHES
    timelines = str(results_dir())
    rows: list[Row] = []
    misses: list[str] = []
    started = time.perf_counter()
    for p in (2,) if args.smoke else (2, 4):
        measured = run_distributed(_rank, p, scale, microbatches, timelines, timeout=600)[0]
        rows += _classic_rows(p, measured, microbatches, misses)
        rows += _split_rows(p, measured, misses)
    elapsed = time.perf_counter() - started
    notes = (
        f"stage time {STEP_S * scale * 1000:.0f} ms forward and backward (naive: "
        f"{NAIVE_STEP_S * scale * 1000:.0f} ms), after a zero-sleep warm-up step; "
        "ratio = theory / measured "
        f"for bubbles (1.0 is exact), gpipe / 1f1b for memory; {elapsed:.0f} s.\n"
        f"split backward: T_F = T_B = T_W = {ZB_STAGE_S * scale * 1000:.0f} ms per stage "
        "(a V chunk: half), 1F1B's whole backward B+W; ratio = 1f1b / schedule for idle time "
        "and memory.\n"
        f"timelines: {timelines}/pipeline_timeline_<schedule>_p<p>_m{TIMELINE_M}.png and "
        "pipeline_timeline_<schedule>_calibrated_p<p>_m<m>.png\n"
        + (
            "all bubbles within 10% of theory, 1f1b memory <= p/m of gpipe, zb1 idles a third "
            "of 1f1b"
            if not misses
            else "MISSES: " + "; ".join(misses)
        )
    )
    if args.smoke:
        notes = "SMOKE RUN (tiny stage times: bubbles not meaningful)\n" + notes
    report("pipeline", rows, notes)


if __name__ == "__main__":
    main()
