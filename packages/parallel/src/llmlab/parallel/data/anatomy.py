"""``StepAnatomy``: where a training step's time goes — forward, backward, gradient communication
(split into the part hidden under backward and the part the step waited for) and optimizer.

Timestamps come from Lightning hooks (batch start, ``on_before_backward``, ``on_after_backward``,
``on_before_optimizer_step``, batch end) plus a ``post_accumulate_grad`` hook on every parameter,
whose last firing marks the end of gradient *computation*. Communication intervals come from the
strategy's ``comm_timeline`` (``BucketedDataParallelStrategy``, ``ParameterServerStrategy``), or,
under plain DDP, from a timing comm hook registered on the ``DistributedDataParallel`` module that
performs the same averaging all-reduce as DDP's default hook. Per step:

    forward  = backward start - batch start           (summed over accumulation micro-batches)
    backward = last gradient produced - backward start
    comm     = |union of communication intervals|;  hidden = the part inside backward
    exposed  = comm - hidden;  optimizer = batch end - on_before_optimizer_step

Metrics go to the logger as ``anatomy/*_ms`` (rank zero); at the end of training a stacked bar
chart PNG and a JSON summary are written to ``out_dir`` and the PNG is logged to W&B.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from llmlab.parallel.data.comm_intervals import CommTimeline, clip, union_length

PHASES = ("forward", "backward", "comm_exposed", "optimizer", "other")
COLOURS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "comm_exposed": "#C44E52",
    "optimizer": "#8172B2",
    "other": "#BBBBBB",
}


def _timed_allreduce_hook(timeline: CommTimeline):
    """A DDP comm hook equal to torch's default (average, then all-reduce) that records timing."""

    def hook(state: Any, bucket: dist.GradBucket):
        start = time.perf_counter()
        group = state if state is not None else dist.group.WORLD
        buffer = bucket.buffer().div_(dist.get_world_size(group))
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()

        def finish(f):
            timeline.add(start, time.perf_counter())
            return f.value()[0]

        return fut.then(finish)

    # DDP checks these annotations as objects; `from __future__ import annotations` made strings
    hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return hook


class StepAnatomy(L.Callback):
    def __init__(
        self, out_dir: str = "benchmarks/results", name: str | None = None, skip_first: int = 2
    ) -> None:
        """``name``: file stem of the chart (default: ``anatomy_<strategy class>``);
        ``skip_first``: warm-up steps left out of the chart's mean."""
        self.out_dir = Path(out_dir)
        self.name = name
        self.skip_first = skip_first
        self.steps: list[dict[str, float]] = []
        self._timeline: CommTimeline | None = None
        self._handles: list[Any] = []
        self._reset_step()

    def _reset_step(self) -> None:
        self._fwd = self._bwd = 0.0
        self._bwd_windows: list[tuple[float, float]] = []
        self._batch_start = self._bwd_start = self._last_grad = self._opt_start = None

    # ------------------------------------------------------------------ set-up
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.nn.parallel import DistributedDataParallel

        strategy = trainer.strategy
        self._timeline = getattr(strategy, "comm_timeline", None)
        if self._timeline is None and isinstance(strategy.model, DistributedDataParallel):
            self._timeline = CommTimeline()
            strategy.model.register_comm_hook(None, _timed_allreduce_hook(self._timeline))
        for p in pl_module.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _grad_ready(self, _: Any) -> None:
        self._last_grad = time.perf_counter()

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        if self._batch_start is None:  # first micro-batch of an optimizer step
            self._batch_start = time.perf_counter()
            if self._timeline is not None:
                self._timeline.drain()
        self._micro_start = time.perf_counter()

    def on_before_backward(self, trainer, pl_module, loss: Any) -> None:
        now = time.perf_counter()
        self._fwd += now - self._micro_start
        self._bwd_start = now
        self._last_grad = None

    def on_after_backward(self, trainer, pl_module) -> None:
        end = self._last_grad or time.perf_counter()
        self._bwd += end - self._bwd_start
        self._bwd_windows.append((self._bwd_start, end))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer: Any) -> None:
        self._opt_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int):
        if self._opt_start is None and not self._is_step_end(trainer):
            return  # an accumulation micro-batch: keep summing
        end = time.perf_counter()
        events = self._timeline.drain() if self._timeline is not None else []
        # A completion callback runs on the backend's thread, possibly a step late under load:
        # only the part of an interval inside this step's window is this step's communication.
        events = clip(events, self._batch_start, end)
        comm = union_length(events)
        hidden = sum(union_length(clip(events, lo, hi)) for lo, hi in self._bwd_windows)
        opt = end - self._opt_start if self._opt_start is not None else 0.0
        # A wait for the last bucket can fall inside the optimizer hook's window: that time is
        # already exposed communication, so it is not counted as optimizer time too.
        if self._opt_start is not None:
            opt -= union_length(clip(events, self._opt_start, end))
        total = end - self._batch_start
        row = {
            "forward": self._fwd,
            "backward": self._bwd,
            "comm": comm,
            "comm_hidden": hidden,
            "comm_exposed": comm - hidden,
            "optimizer": opt,
            "total": total,
        }
        row["other"] = max(0.0, total - sum(row[k] for k in PHASES if k != "other"))
        self.steps.append(row)
        if trainer.is_global_zero and trainer.logger is not None:
            metrics = {f"anatomy/{k}_ms": v * 1e3 for k, v in row.items()}
            metrics["anatomy/hidden_fraction"] = hidden / comm if comm > 0 else 0.0
            trainer.logger.log_metrics(metrics, step=trainer.global_step)
        self._reset_step()

    @staticmethod
    def _is_step_end(trainer: L.Trainer) -> bool:
        return not trainer.fit_loop._should_accumulate()

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict[str, float]:
        rows = self.steps[self.skip_first :] or self.steps
        keys = [*PHASES, "comm", "comm_hidden", "total"]
        mean = {k: sum(r[k] for r in rows) / max(len(rows), 1) for k in keys}
        mean["hidden_fraction"] = mean["comm_hidden"] / mean["comm"] if mean["comm"] else 0.0
        mean["steps"] = len(rows)
        return mean

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if not trainer.is_global_zero or not self.steps:
            return
        name = self.name or f"anatomy_{type(trainer.strategy).__name__}"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        summary = self.summary()
        (self.out_dir / f"{name}.json").write_text(
            json.dumps({"name": name, "mean_s": summary, "steps": self.steps}, indent=2)
        )
        png = plot_anatomy({name: summary}, self.out_dir / f"{name}.png")
        log_image = getattr(trainer.logger, "log_image", None)
        if log_image is not None:
            log_image(key="anatomy/step", images=[str(png)])


def plot_anatomy(summaries: dict[str, dict[str, float]], path: str | Path) -> Path:
    """One stacked bar per run (mean ms per step by phase); hidden comm drawn as a hatched bar
    beside the backward segment it overlapped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(summaries)
    fig, ax = plt.subplots(figsize=(3.8 + 1.6 * len(labels), 4.5), layout="constrained")
    for x, label in enumerate(labels):
        s, bottom = summaries[label], 0.0
        for phase in PHASES:
            h = s[phase] * 1e3
            ax.bar(
                x,
                h,
                bottom=bottom,
                color=COLOURS[phase],
                width=0.55,
                label=phase.replace("_", " ") if x == 0 else None,
            )
            if phase == "backward" and s["comm_hidden"] > 0:
                ax.bar(
                    x + 0.36,
                    s["comm_hidden"] * 1e3,
                    bottom=bottom + h - s["comm_hidden"] * 1e3,
                    width=0.15,
                    color="none",
                    edgecolor=COLOURS["comm_exposed"],
                    hatch="///",
                    label="comm hidden under backward" if x == 0 else None,
                )
            bottom += h
        ax.text(
            x,
            bottom,
            f"{bottom:.0f} ms\nhidden {s['hidden_fraction']:.0%}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(labels)), [l.removeprefix("anatomy_") for l in labels], fontsize=8)
    ax.margins(y=0.15)  # room for the totals above the bars
    ax.set_ylabel("mean time per step (ms)")
    ax.set_title("Step anatomy")
    fig.legend(fontsize=7, loc="outside right upper")  # outside the axes: hides no bar
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m llmlab.parallel.data.anatomy OUT.png run1.json run2.json ...``: one chart
    comparing runs written by ``StepAnatomy``."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m llmlab.parallel.data.anatomy OUT.png RUN.json [RUN.json ...]")
        return 2
    summaries = {}
    for p in args[1:]:
        data = json.loads(Path(p).read_text())
        summaries[data["name"]] = data["mean_s"]
    print(plot_anatomy(summaries, args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
