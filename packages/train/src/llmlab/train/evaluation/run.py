"""Run lm-eval tasks on an llmlab model and report: a console table, a JSON file, W&B.

The tasks are llmlab's, defined by the files in ``tasks/`` (no download): ``shakespeare_bpb``
(word / byte perplexity and bits per byte of the held-out works, ``bits_per_byte = -Σ log p /
(ln 2 · bytes)``) and ``shakespeare_cloze`` (multiple choice, accuracy). lm-eval's own task
index (hundreds of hub datasets) is not loaded unless ``include_defaults=True``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def available_tasks() -> list[str]:
    """llmlab's task names: the ``task:`` of each YAML file in ``tasks/`` (read without lm-eval)."""
    names = []
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("task:"):
                names.append(line.split(":", 1)[1].strip())
    return names


def check_tasks(tasks: list[str], include_defaults: bool = False) -> None:
    """Refuse an unknown task name before any model is loaded (lm-eval's own names are only
    checked by lm-eval, with ``include_defaults``)."""
    if not tasks:
        raise ValueError(f"no eval tasks given; llmlab's: {', '.join(available_tasks())}")
    unknown = [t for t in tasks if t not in available_tasks()]
    if unknown and not include_defaults:
        raise ValueError(
            f"unknown eval task(s) {unknown}; llmlab's: {', '.join(available_tasks())} "
            "(lm-eval's own tasks need --include-defaults and usually a download)"
        )


def evaluate(
    model: Any,
    tokenizer: Any,
    tasks: list[str],
    limit: int | float | None = None,
    batch_size: int = 16,
    metadata: dict[str, Any] | None = None,
    include_defaults: bool = False,
) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``model`` (through :class:`LlmlabLM`) on ``tasks``;
    ``metadata`` reaches the task files (``max_chars`` shortens ``shakespeare_bpb``'s works)."""
    check_tasks(tasks, include_defaults)
    import lm_eval
    from lm_eval.tasks import TaskManager

    from llmlab.train.evaluation.lm import LlmlabLM

    manager = TaskManager(
        include_path=str(TASKS_DIR), include_defaults=include_defaults, metadata=metadata or {}
    )
    results = lm_eval.simple_evaluate(
        model=LlmlabLM(model, tokenizer, batch_size=batch_size),
        tasks=list(tasks),
        limit=limit,
        task_manager=manager,
        log_samples=False,
        bootstrap_iters=0,
    )
    return results


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """``{"eval/<task>/<metric>": value}`` of every numeric result (lm-eval's ``metric,filter``
    keys lose their ``,none`` filter suffix)."""
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if numeric and "stderr" not in key and key != "sample_len":
                name = key.split(",")[0]
                if math.isfinite(float(value)):
                    out[f"eval/{task}/{name}"] = float(value)
    return out


def table(results: dict[str, Any]) -> str:
    from lm_eval.utils import make_table

    return make_table(results)


def write_json(results: dict[str, Any], path: Path) -> Path:
    """lm-eval's ``results``, ``versions``, ``n-shot`` and ``configs`` and the flat metrics,
    as JSON, atomically."""
    keep = {k: results[k] for k in ("results", "versions", "n-shot", "configs") if k in results}
    keep["metrics"] = flat_metrics(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(keep, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def log_to_wandb_run(run_dir: Path, metrics: dict[str, float]) -> str | None:
    """Add ``metrics`` to the W&B run of the training run at ``run_dir`` (resumed by its id,
    offline unless ``WANDB_MODE`` or the run's config says otherwise); returns the run id."""
    id_file = run_dir / "run_id"
    if not id_file.is_file():
        return None
    import wandb
    import yaml

    config = (
        yaml.safe_load((run_dir / "config.yaml").read_text())
        if (run_dir / "config.yaml").is_file()
        else {}
    )
    logger = (config or {}).get("logger") or {}
    run_id = id_file.read_text().strip()
    run = wandb.init(
        id=run_id,
        project=logger.get("project", "llmlab"),
        entity=logger.get("entity"),
        dir=str(run_dir),
        resume="allow",
        mode=os.environ.get("WANDB_MODE", logger.get("mode", "offline")),
    )
    run.log(metrics)
    run.summary.update(metrics)
    run.finish()
    return run_id
