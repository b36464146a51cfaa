"""``make compare``: put finished runs side by side — what differs in their configs, how they did.

    python -m llmlab.train.compare [RUN ...] [--group NAME] [--last N] [--out PLOT.png]
                                   [--dir OUTPUT_DIR] [--json FILE] [--online --project E/P]

RUN is a run id (or a unique prefix), a run directory, or ``outputs/<experiment>/latest``.
``--group NAME`` adds every run of experiment NAME; ``--last N`` keeps the newest N of the
selection (of all runs when nothing else is given). ``group=NAME``, ``last=N`` and ``out=PATH``
are accepted too, so ``make compare RUNS="group=gpt_ddp"`` works. Runs are read from local W&B
folders with no network; ``--online`` reads ``entity/project/run_id`` specs (or ``--group`` of
``--project``) through the W&B API instead.

It prints two tables — the config keys whose values differ between the runs, and per run the
final/best metrics (best and final val loss, final train loss, median tokens/s and MFU over the
logged steps, peak memory, wall time) — and writes a PNG of the loss curves overlaid, with
throughput on a second axis. Unknown runs exit with status 2 and a message naming what exists.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from llmlab.train.runs import (
    Run,
    RunNotFoundError,
    group_api_runs,
    output_dir,
    read_api_run,
    read_local_run,
    resolve_local,
)

# Config keys that differ between any two runs by construction (paths holding the run id).
VOLATILE_KEYS = ("run_dir", "callbacks.checkpoint.dirpath")


# --------------------------------------------------------------------------- config diff
def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _volatile(key: str, value: Any) -> bool:
    # An object's repr carries its address; a path under the run dir carries the run id.
    return key in VOLATILE_KEYS or (isinstance(value, str) and " object at 0x" in value)


def config_diff(runs: list[Run]) -> dict[str, list[Any]]:
    """The config keys whose values are not the same in every run (missing counts as a value)."""
    flats = [flatten(run.config) for run in runs]
    keys = sorted(set().union(*flats)) if flats else []
    diff = {}
    for key in keys:
        values = [flat.get(key, "—") for flat in flats]
        if any(_volatile(key, v) for v in values):
            continue
        if any(
            json.dumps(v, sort_keys=True, default=str)
            != json.dumps(values[0], sort_keys=True, default=str)
            for v in values
        ):
            diff[key] = values
    return diff


# --------------------------------------------------------------------------- metrics
def summarize(run: Run) -> dict[str, float | None]:
    """The comparison figures of one run, all from its logged history.

    Throughput and MFU are medians over the logged steps: the first steps pay warm-up costs
    and a shared machine adds outliers, which a mean would carry into the comparison.
    """
    _, train_loss = run.series("train/loss")
    loss_steps, _ = run.series("train/loss")
    _, val_loss = run.series("val/loss")
    _, tokens = run.series("train/tokens_per_sec")
    _, mfu = run.series("train/mfu")
    _, memory = run.series("sys/peak_memory_mb")
    return {
        "steps": (max(loss_steps) + 1) if loss_steps else None,
        "train_loss_final": train_loss[-1] if train_loss else None,
        "val_loss_best": min(val_loss) if val_loss else None,
        "val_loss_final": val_loss[-1] if val_loss else None,
        "tokens_per_sec": statistics.median(tokens) if tokens else None,
        "mfu": statistics.median(mfu) if mfu else None,
        "peak_memory_mb": max(memory) if memory else None,
        "wall_time_s": run.runtime_s,
    }


METRIC_COLUMNS = [
    ("steps", "steps", "{:.0f}"),
    ("val_loss_best", "val/loss best", "{:.4f}"),
    ("val_loss_final", "val/loss final", "{:.4f}"),
    ("train_loss_final", "train/loss final", "{:.4f}"),
    ("tokens_per_sec", "tokens/s (median)", "{:,.0f}"),
    ("mfu", "MFU (median)", "{:.2%}"),
    ("peak_memory_mb", "peak mem MB", "{:,.0f}"),
    ("wall_time_s", "wall s", "{:,.1f}"),
]


# --------------------------------------------------------------------------- output
def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _short(value: Any, width: int = 28) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def run_label(run: Run) -> str:
    return f"{run.group}/{run.run_id}"


def format_report(runs: list[Run], metrics: list[dict[str, float | None]]) -> str:
    labels = [run_label(r) for r in runs]
    diff = config_diff(runs)
    parts = [f"Comparing {len(runs)} run(s): " + ", ".join(labels), ""]
    if diff:
        parts += [
            "Config keys that differ",
            _table(["key", *labels], [[k, *map(_short, v)] for k, v in diff.items()]),
        ]
    else:
        parts.append("Configs: identical (apart from run paths)")
    rows = []
    for label, m in zip(labels, metrics):
        rows.append(
            [label]
            + ["—" if m[key] is None else fmt.format(m[key]) for key, _, fmt in METRIC_COLUMNS]
        )
    parts += ["", "Metrics", _table(["run", *[title for _, title, _ in METRIC_COLUMNS]], rows)]
    return "\n".join(parts)


def plot_runs(runs: list[Run], path: Path) -> Path:
    """Overlaid loss curves (train solid, val dashed with markers) and tokens/s on a twin axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5), layout="constrained")  # room for the legend
    speed_ax = ax.twinx()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        label = run_label(run)
        ax.plot(*run.series("train/loss"), color=color, lw=1.5, label=f"{label} train")
        steps, val = run.series("val/loss")
        if val:
            ax.plot(steps, val, color=color, ls="--", marker="o", ms=3, label=f"{label} val")
        steps, tokens = run.series("train/tokens_per_sec")
        if tokens:
            speed_ax.plot(steps, tokens, color=color, ls=":", lw=1, alpha=0.6)
    ax.set_xlabel("optimizer step (trainer/global_step)")
    ax.set_ylabel("loss (nats/token)")
    speed_ax.set_ylabel("tokens/s (dotted)")
    ax.grid(alpha=0.3)
    # Outside the axes, so that no curve is ever hidden behind it.
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="outside right upper")
    ax.set_title("loss curves (solid: train, dashed: val); throughput dotted, right axis")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- CLI
def _normalise_argv(argv: list[str]) -> list[str]:
    """Accept ``group=X last=N out=P dir=D`` (the Makefile's RUNS="..." style) as flags."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in ("group", "last", "out", "dir", "json", "project"):
            out += [f"--{key}", value]
        else:
            out.append(arg)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llmlab.train.compare",
        description="Compare training runs: config differences, final/best metrics, loss plot.",
    )
    parser.add_argument("runs", nargs="*", help="run ids (or prefixes), run dirs, or <exp>/latest")
    parser.add_argument("--group", help="every run of this experiment (W&B group)")
    parser.add_argument("--last", type=int, help="keep the newest N runs of the selection")
    parser.add_argument(
        "--dir", type=Path, help="output dir to search (default $LLMLAB_OUTPUT_DIR or outputs)"
    )
    parser.add_argument("--out", type=Path, help="plot path (default <dir>/compare.png)")
    parser.add_argument("--json", type=Path, help="also write the table data as JSON here")
    parser.add_argument("--online", action="store_true", help="read runs through the W&B API")
    parser.add_argument("--project", help="entity/project for --online --group")
    return parser


def load_runs(args: argparse.Namespace) -> list[Run]:
    if args.online:
        specs = list(args.runs)
        if args.group:
            if not args.project:
                raise RunNotFoundError("--online --group needs --project ENTITY/PROJECT")
            specs += group_api_runs(args.project, args.group)
        if not specs:
            raise RunNotFoundError("--online needs run paths entity/project/run_id or --group")
        runs = [read_api_run(spec) for spec in specs]
        return runs[-args.last :] if args.last else runs
    root = args.dir or output_dir()
    if not (args.runs or args.group or args.last):
        raise RunNotFoundError("say which runs: run ids or dirs, --group NAME, and/or --last N")
    return [read_local_run(d) for d in resolve_local(args.runs, args.group, args.last, root)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_normalise_argv(sys.argv[1:] if argv is None else argv))
    try:
        runs = load_runs(args)
    except (RunNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    metrics = [summarize(run) for run in runs]
    print(format_report(runs, metrics))
    out = args.out or (args.dir or output_dir()) / "compare.png"
    plot_runs(runs, out)
    print(f"\nplot: {out}")
    if args.json:
        payload = [
            {"run_id": r.run_id, "group": r.group, "path": r.path, **m}
            for r, m in zip(runs, metrics)
        ]
        args.json.write_text(
            json.dumps({"runs": payload, "config_diff": config_diff(runs)}, indent=2, default=str)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
