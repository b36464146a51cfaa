"""Read finished training runs back: from local W&B run folders (no network) or the W&B API.

A local run is what ``python -m llmlab.train`` leaves in
``<output dir>/<experiment>/<timestamp>-<run id>/``: a ``run_id`` file and the offline W&B run
``wandb/offline-run-*/run-<id>.wandb``. W&B's own reader, ``wandb leet inspect --json``, turns
that binary log into one JSON record per line (``run``, ``config``, ``history``, ``summary``,
``exit``...), so we never parse the ``.wandb`` format ourselves. With ``--online`` (and a
``wandb login``), ``entity/project/run_id`` is read through ``wandb.Api`` instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RunNotFoundError(LookupError):
    """A requested run (id, directory or group) does not exist where we looked."""


@dataclass
class Run:
    """One training run: its identity, its resolved config and its logged metrics."""

    run_id: str
    group: str
    name: str
    path: str  # the run directory (local) or ``entity/project/id`` (online)
    config: dict[str, Any]
    history: list[dict[str, Any]]  # one dict per W&B step, in logging order
    summary: dict[str, Any] = field(default_factory=dict)
    start_time: str = ""
    runtime_s: float | None = None  # wall time from W&B's exit record (or the last _runtime)
    exit_code: int | None = None

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """``(trainer/global_step, value)`` pairs of every history row that logged ``key``."""
        steps, values = [], []
        for row in self.history:
            if key in row and row[key] is not None:
                steps.append(float(row.get("trainer/global_step", row.get("_step", len(steps)))))
                values.append(float(row[key]))
        return steps, values


# --------------------------------------------------------------------------- local discovery
def output_dir() -> Path:
    """Where the training app writes runs: ``$LLMLAB_OUTPUT_DIR`` or ``./outputs``."""
    return Path(os.environ.get("LLMLAB_OUTPUT_DIR", "outputs"))


def wandb_run_dir(run_dir: Path) -> Path:
    """The W&B run folder inside a training run directory (or ``run_dir`` itself if it is one)."""
    run_dir = Path(run_dir)
    if list(run_dir.glob("run-*.wandb")):
        return run_dir
    found = sorted((run_dir / "wandb").glob("*run-*"), key=lambda p: p.name)
    found = [p for p in found if p.is_dir() and list(p.glob("run-*.wandb"))]
    if not found:
        raise RunNotFoundError(f"{run_dir} holds no W&B run (no wandb/offline-run-*/run-*.wandb)")
    return found[-1]  # a resumed run appends to the same id; the newest folder is the latest


def local_run_dirs(root: Path | None = None) -> list[Path]:
    """Every training run directory under ``root`` (``<experiment>/<stamp>-<id>/``), oldest first.

    Only runs that have a W&B run folder count (``WANDB_MODE=disabled`` runs leave none).
    """
    root = output_dir() if root is None else Path(root)
    dirs = [
        p
        for p in root.glob("*/*")
        if p.is_dir()
        and (p / "run_id").is_file()
        and list((p / "wandb").glob("*run-*/run-*.wandb"))
    ]
    return sorted(dirs, key=creation_order)


def creation_order(run_dir: Path) -> tuple[str, int, str]:
    """Sort key, oldest first: the name's ``%Y%m%d-%H%M%S`` stamp, then (for runs started in the
    same second, whose random ids would order them by chance) when its ``run_id`` file was
    written, which happens once, when the run directory is created."""
    run_id = run_dir / "run_id"
    written = run_id.stat().st_mtime_ns if run_id.is_file() else 0
    return run_dir.name[:15], written, str(run_dir)


def _leet_command() -> list[str]:
    exe = Path(sys.executable).with_name("wandb")
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("wandb")
    if found:
        return [found]
    return [sys.executable, "-m", "wandb"]


def inspect_records(wandb_dir: Path) -> list[dict[str, Any]]:
    """The W&B run's records as W&B itself decodes them (``wandb leet inspect --json``)."""
    proc = subprocess.run(
        [*_leet_command(), "leet", "inspect", "--json", str(wandb_dir)],
        capture_output=True,
        text=True,
        env={**os.environ, "WANDB_SILENT": "true"},
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"`wandb leet inspect --json {wandb_dir}` failed ({proc.returncode}): "
            f"{proc.stderr.strip()[-500:]}"
        )
    records = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            records.append(json.loads(line))
    return records


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def run_from_records(records: list[dict[str, Any]], path: str) -> Run:
    """Fold W&B's record stream into a ``Run`` (config updates merge; summary updates overwrite)."""
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    exit_record: dict[str, Any] = {}
    for rec in records:
        kind = rec.get("type")
        body = rec.get(kind, {}) if isinstance(kind, str) else {}
        if kind == "run":
            info = body
            _merge(config, body.get("config", {}).get("update", {}))
        elif kind == "config":
            _merge(config, body.get("update", {}))
        elif kind == "history":
            history.append(dict(body.get("item", {})))
        elif kind == "summary":
            summary.update(body.get("update", {}))
        elif kind == "exit":
            exit_record = body
    config.pop("_wandb", None)
    runtime = exit_record.get("runtime")
    if runtime is None and history:
        runtime = history[-1].get("_runtime")
    return Run(
        run_id=str(info.get("run_id", "")),
        group=str(info.get("run_group", config.get("experiment", ""))),
        name=str(info.get("display_name", "")),
        path=path,
        config=config,
        history=history,
        summary=summary,
        start_time=str(info.get("start_time", "")),
        runtime_s=None if runtime is None else float(runtime),
        exit_code=exit_record.get("exit_code"),
    )


def read_local_run(run_dir: Path) -> Run:
    """Read one training run directory (or a bare W&B run folder) with no network."""
    run_dir = Path(run_dir)
    wdir = wandb_run_dir(run_dir)
    home = run_dir if wdir != run_dir else wdir.parent.parent
    run = run_from_records(inspect_records(wdir), str(home))
    if not run.run_id and (home / "run_id").is_file():
        run.run_id = (home / "run_id").read_text().strip()
    return run


# --------------------------------------------------------------------------- online
def read_api_run(path: str) -> Run:
    """Read ``entity/project/run_id`` through the W&B public API (needs network + login)."""
    import wandb

    api_run = wandb.Api().run(path)
    history = [dict(row) for row in api_run.scan_history()]
    return Run(
        run_id=api_run.id,
        group=api_run.group or "",
        name=api_run.name or "",
        path=path,
        config={k: v for k, v in dict(api_run.config).items() if not k.startswith("_")},
        history=history,
        summary=dict(api_run.summary),
        start_time=str(getattr(api_run, "created_at", "")),
        runtime_s=api_run.summary.get("_runtime"),
    )


def group_api_runs(entity_project: str, group: str) -> list[str]:
    """``entity/project/id`` of every run in ``group`` of a W&B project (online)."""
    import wandb

    runs = wandb.Api().runs(entity_project, filters={"group": group})
    return [f"{entity_project}/{r.id}" for r in runs]


# --------------------------------------------------------------------------- selection
def resolve_local(
    specs: list[str], group: str | None = None, last: int | None = None, root: Path | None = None
) -> list[Path]:
    """Run directories for run ids / directories ``specs``, a ``group``, and/or the ``last`` N.

    - a spec that is a directory: that run (a run dir, its W&B folder, or ``<exp>/latest``'s
      target via the ``latest`` file);
    - otherwise a run id (or a unique prefix of one) among the runs under ``root``;
    - ``group``: every run of that experiment; ``last``: the newest N of the selection (of all
      runs when nothing else is given).
    Unknown ids or an empty group raise ``RunNotFoundError`` naming what exists.
    """
    root = output_dir() if root is None else Path(root)
    every = local_run_dirs(root)
    chosen: list[Path] = []
    for spec in specs:
        path = Path(spec)
        if path.is_file() and path.name == "latest":
            path = Path(path.read_text().strip())
        if path.is_dir():
            chosen.append(path.resolve())
            continue
        matches = [d for d in every if (d / "run_id").read_text().strip().startswith(spec)]
        if len(matches) != 1:
            known = ", ".join(
                f"{d.parent.name}/{(d / 'run_id').read_text().strip()}" for d in every
            )
            why = "is ambiguous" if matches else "matches no run"
            raise RunNotFoundError(
                f"run {spec!r} {why} under {root.resolve()} "
                f"(known runs: {known or 'none; train one with `make train`'})"
            )
        chosen.append(matches[0].resolve())
    if group is not None:
        in_group = [d.resolve() for d in every if d.parent.name == group]
        if not in_group:
            groups = sorted({d.parent.name for d in every})
            raise RunNotFoundError(
                f"group {group!r} has no runs with a W&B log under {root.resolve()} "
                f"(groups with runs: {', '.join(groups) or 'none'})"
            )
        chosen.extend(d for d in in_group if d not in chosen)
    if last is not None:
        if last < 1:
            raise ValueError(f"--last must be a positive number of runs, got {last}")
        pool = chosen if (specs or group is not None) else [d.resolve() for d in every]
        if not pool:
            raise RunNotFoundError(f"no runs with a W&B log under {root.resolve()}")
        chosen = sorted(pool, key=creation_order)[-last:]
    return chosen
