"""``make compare`` on three real runs: its table must carry the runs' own logged numbers.

The oracle is independent of our W&B reader: a Lightning callback (``metric_recorder``) writes
down every logged value inside the training process, and Lightning's ``ModelCheckpoint``
remembers the best val/loss in the checkpoint. W&B's own ``--summary`` view is the second
cross-check for the final values. Tolerance: float32 values round-tripped through W&B, rel 1e-6.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmlab.train import compare
from llmlab.train.runs import (
    RunNotFoundError,
    local_run_dirs,
    read_local_run,
    resolve_local,
    wandb_run_dir,
)
from tests.helpers.runs import REPO, train_env

TINY = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "data.batch_size=4",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
    "task.warmup_steps=2",
    "+callbacks.recorder._target_=tests.train.metric_recorder.MetricRecorder",
]
VARIANTS = [["task.lr=2e-3"], ["task.lr=1e-3"], ["task.lr=2e-3", "model.n_layer=2"]]

# Three runs in one interpreter: saves two cold imports of torch + Lightning on a busy machine.
DRIVER = """
import json, os, sys, wandb
from llmlab.train.app import main
for args in json.loads(sys.argv[1]):
    for key in ("LLMLAB_RUN_DIR", "LLMLAB_RUN_ID"):
        os.environ.pop(key, None)
    assert main(args) == 0, args
    wandb.finish()
"""


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compare_runs")
    cache = f"paths.cache_dir={tmp_path_factory.getbasetemp() / 'llmlab-data-cache'}"
    runs = [["experiment=gpt_shakespeare", *TINY, *v, cache] for v in VARIANTS]
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(runs)],
        cwd=REPO,
        env=train_env(out, wandb_mode="offline"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def _summary_view(run_dir: Path) -> dict:
    wandb = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb), "leet", "inspect", "--summary", "--json", str(wandb_run_dir(run_dir))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)["summary"]


def test_compare_table_and_plot_match_the_runs_own_values(three_runs, tmp_path, capsys):
    plot, table = tmp_path / "cmp.png", tmp_path / "cmp.json"
    rc = compare.main(
        [
            "--group",
            "gpt_shakespeare",
            "--dir",
            str(three_runs),
            "--out",
            str(plot),
            "--json",
            str(table),
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    assert "Config keys that differ" in printed and "Metrics" in printed
    for key in ("task.lr", "model.n_layer"):
        assert key in printed
    assert "run_dir" not in printed and "ByteTokenizer object" not in printed

    data = json.loads(table.read_text())
    assert set(data["config_diff"]) >= {"task.lr", "model.n_layer"}
    assert data["config_diff"]["model.n_layer"] == [1, 1, 2]
    assert len(data["runs"]) == 3
    for row in data["runs"]:
        run_dir = Path(row["path"])
        own = json.loads((run_dir / "recorded_metrics.json").read_text())
        steps = own["steps"]
        assert row["steps"] == len(steps) == 4
        assert _close(row["train_loss_final"], steps[-1]["train/loss"])
        assert _close(row["val_loss_final"], own["val_losses"][-1])
        assert _close(row["val_loss_best"], min(own["val_losses"]))
        for key, name in (("tokens_per_sec", "train/tokens_per_sec"), ("mfu", "train/mfu")):
            assert _close(row[key], statistics.median(s[name] for s in steps))
        assert _close(row["peak_memory_mb"], max(s["sys/peak_memory_mb"] for s in steps))
        assert row["wall_time_s"] >= own["fit_seconds"]  # the W&B run wraps the whole fit

        ckpt = torch.load(
            run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False
        )
        best = next(v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint"))
        assert _close(row["val_loss_best"], float(best["best_model_score"]))
        summary = _summary_view(run_dir)  # W&B's own view of the final values
        assert _close(row["train_loss_final"], summary["train/loss"])
        assert _close(row["val_loss_final"], summary["val/loss"])

    import matplotlib.image

    image = matplotlib.image.imread(plot)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_selection_by_id_prefix_last_n_and_latest(three_runs):
    every = resolve_local([], last=3, root=three_runs)
    assert len(every) == 3
    ids = [(d / "run_id").read_text().strip() for d in every]
    assert resolve_local([ids[1][:6]], root=three_runs) == [every[1]]
    assert resolve_local([], last=2, root=three_runs) == every[1:]
    latest = three_runs / "gpt_shakespeare" / "latest"
    assert resolve_local([str(latest)], root=three_runs) == [every[2]]
    run = read_local_run(every[0])
    assert run.run_id == ids[0] and run.group == "gpt_shakespeare"
    assert run.config["task"]["lr"] == pytest.approx(2e-3)


def test_unknown_run_exits_2_naming_the_known_runs(three_runs):
    proc = subprocess.run(
        [sys.executable, "-m", "llmlab.train.compare", "nosuchrun", "--dir", str(three_runs)],
        cwd=REPO,
        env={**os.environ, "LLMLAB_OUTPUT_DIR": str(three_runs)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "run 'nosuchrun' matches no run" in proc.stderr
    assert "gpt_shakespeare/" in proc.stderr  # names what exists
    with pytest.raises(RunNotFoundError, match=r"group 'gpt_nope' has no runs.*gpt_shakespeare"):
        resolve_local([], group="gpt_nope", root=three_runs)
    assert compare.main(["--dir", str(three_runs)]) == 2  # nothing selected: say so, not crash


def test_runs_started_in_the_same_second_keep_their_creation_order(tmp_path):
    """Run dirs are named ``<%Y%m%d-%H%M%S>-<random id>``: within one second the id must not
    decide which run is "latest" (a fresh-clone CI run once made three runs in one second)."""
    made = []
    for i, run_id in enumerate(["ffffffff", "00000000", "80000000"]):
        run = tmp_path / "exp" / f"20261202-163617-{run_id}"
        (run / "wandb" / f"offline-run-x-{run_id}").mkdir(parents=True)
        (run / "wandb" / f"offline-run-x-{run_id}" / f"run-{run_id}.wandb").touch()
        (run / "run_id").write_text(run_id + "\n")
        os.utime(run / "run_id", ns=(1_000_000_000 + i, 1_000_000_000 + i))
        made.append(run)
    assert local_run_dirs(tmp_path) == made
    assert resolve_local([], last=1, root=tmp_path) == [made[-1].resolve()]
