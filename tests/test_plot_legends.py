"""Every chart the project draws keeps its legend outside the plotting area.

Inside, the pipeline timeline's legend covered stage 0's last backward boxes (1F1B, p=4, m=8).
Each plotter here is run on small real inputs; the figure is caught as it is closed and the
legend's rendered box must not intersect any axes' box (exact pixel boxes, no tolerance).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # what the plotters select themselves
import matplotlib.pyplot as plt
import pytest

from llmlab.parallel.data.anatomy import PHASES, plot_anatomy
from llmlab.parallel.pipeline.schedules import all_schedules
from llmlab.parallel.pipeline.simulator import simulate
from llmlab.parallel.pipeline.timeline import plot_timeline
from llmlab.train.compare import plot_runs
from llmlab.train.runs import Run


@pytest.fixture
def closed_figures(monkeypatch):
    """The figures the plotters close, still drawable."""
    caught = []
    monkeypatch.setattr(plt, "close", lambda fig=None: caught.append(fig))
    return caught


def _legend_clear_of_axes(fig) -> None:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    assert legends, "the chart has no legend"
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            area = ax.get_window_extent(renderer)
            assert not box.overlaps(area), f"legend {box} overlaps axes {area}"


def test_pipeline_timeline(tmp_path, closed_figures):
    events = simulate(all_schedules("1f1b", 4, 8), 1.0, 2.0).events
    plot_timeline(events, 4, tmp_path / "timeline.png", title="1f1b p=4 m=8")
    _legend_clear_of_axes(closed_figures[-1])


def test_pipeline_timeline_split_backward(tmp_path, closed_figures):
    """ZB-V draws F, B and W apart (two chunks per rank); the legend names all three."""
    events = simulate(all_schedules("zbv", 4, 8, 2), 1.0, 1.0, weight_cost=1.0).events
    plot_timeline(events, 4, tmp_path / "timeline.png", title="zbv p=4 m=8")
    fig = closed_figures[-1]
    _legend_clear_of_axes(fig)
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert labels == ["F (forward)", "B (input gradient)", "W (weight gradients)"]


def _history(offset: float) -> list[dict[str, float]]:
    rows = []
    for step in range(20):
        row = {"trainer/global_step": step, "train/loss": 3.0 - 0.1 * step + offset}
        row["train/tokens_per_sec"] = 1000.0 + step
        if step % 5 == 0:
            row["val/loss"] = 3.1 - 0.1 * step + offset
        rows.append(row)
    return rows


def test_compare_loss_curves(tmp_path, closed_figures):
    runs = [
        Run(f"run{i}", "gpt_shakespeare", f"run{i}", str(tmp_path), {}, _history(0.1 * i))
        for i in range(3)
    ]
    plot_runs(runs, tmp_path / "compare.png")
    _legend_clear_of_axes(closed_figures[-1])


def test_comm_step_anatomy(tmp_path, closed_figures):
    summary = {phase: 0.01 for phase in PHASES}
    summary.update(comm_hidden=0.004, hidden_fraction=0.4)
    plot_anatomy({"anatomy_ddp": summary, "anatomy_bucketed": summary}, tmp_path / "a.png")
    _legend_clear_of_axes(closed_figures[-1])
