"""Measured timelines: the bubble fraction and a Gantt chart like the pipeline papers' figures.

Every stage records the start and end of each instruction relative to a common barrier; rank 0
gathers the records. The measured bubble uses the same definition as the simulator: the idle
share of the ``stages × makespan`` rectangle, ``1 - Σ compute / (p · makespan)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from llmlab.parallel.pipeline.simulator import TimelineEvent

COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
# (first chunk, second chunk) per kind; the legend names them as the papers do
COLOURS = {
    "forward": ("#4C72B0", "#8FB3E0"),
    "backward": ("#55A868", "#9AD3A6"),
    "backward_input": ("#DD8452", "#F2BE9A"),
    "backward_weight": ("#8172B3", "#BDB4DC"),
}
LEGEND = {
    "forward": "F (forward)",
    "backward": "B+W (whole backward)",
    "backward_input": "B (input gradient)",
    "backward_weight": "W (weight gradients)",
}


def measured_bubble(events: Sequence[TimelineEvent], num_stages: int) -> float:
    """Idle fraction of the pipeline, from every stage's recorded events."""
    compute = [e for e in events if e.op in COMPUTE]
    if not compute:
        return 0.0
    start = min(e.start for e in events)
    end = max(e.end for e in events)
    busy = sum(e.end - e.start for e in compute)
    return 1.0 - busy / (num_stages * (end - start))


def gather_events(
    events: Sequence[TimelineEvent], group: dist.ProcessGroup | None = None
) -> list[TimelineEvent]:
    """Every stage's events, on every rank of ``group`` (a pipeline)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(events)
    gathered: list[list[TimelineEvent] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(events), group=group)
    return [e for part in gathered for e in (part or [])]


def plot_timeline(
    events: Sequence[TimelineEvent],
    num_stages: int,
    path: str | Path,
    title: str = "",
) -> Path:
    """A Gantt chart: one row per stage (stage 0 on top), forwards blue, whole backwards green,
    B (input gradient) orange, W (weight gradients) purple, a lighter shade for a rank's second
    chunk; the micro-batch number written in each box (``mb.chunk`` with several chunks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compute = [e for e in events if e.op in COMPUTE]
    chunks = max((e.chunk for e in compute), default=0) + 1
    fig, ax = plt.subplots(
        figsize=(max(6.0, 0.35 * len(compute) / max(1, num_stages)), 0.6 + 0.5 * num_stages),
        layout="constrained",  # makes room for the legend outside the axes
    )
    t0 = min((e.start for e in events), default=0.0)
    for e in compute:
        colour = COLOURS[e.op][e.chunk % 2]
        width = e.end - e.start
        ax.barh(
            num_stages - 1 - e.stage,
            width,
            left=e.start - t0,
            height=0.8,
            color=colour,
            edgecolor="black",
            linewidth=0.4,
        )
        label = str(e.microbatch) if chunks == 1 else f"{e.microbatch}.{e.chunk}"
        ax.text(
            e.start - t0 + width / 2,
            num_stages - 1 - e.stage,
            label,
            ha="center",
            va="center",
            fontsize=7,
            color="white" if e.chunk % 2 == 0 else "black",
        )
    ax.set_yticks(range(num_stages))
    ax.set_yticklabels([f"stage {s}" for s in reversed(range(num_stages))])
    ax.set_xlabel("time (s)")
    bubble = measured_bubble(events, num_stages)
    ax.set_title(f"{title}  bubble {bubble:.1%}".strip())
    kinds = [k for k in COMPUTE if any(e.op == k for e in compute)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k][0]) for k in kinds]
    # Outside the axes: inside, it covered stage 0's last backward boxes.
    fig.legend(handles, [LEGEND[k] for k in kinds], loc="outside right upper", fontsize=7)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
