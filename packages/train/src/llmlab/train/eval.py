"""``python -m llmlab.train.eval CKPT --tasks shakespeare_bpb,shakespeare_cloze``
(``make eval CKPT=... TASKS=...``): lm-evaluation-harness on a training checkpoint.

``CKPT`` is a ``.ckpt``, a sharded checkpoint folder or a run directory (its last checkpoint).
The model runs through :class:`llmlab.train.evaluation.lm.LlmlabLM` (batched, KV-cached with
``llmlab.decoding``) on llmlab's task files (no download). Results: a table on the console,
``<run dir>/eval/<checkpoint>.json``, and the run's W&B run, resumed by its id (offline by
default, as training). Options: ``--limit N`` documents per task, ``--batch-size``,
``--max-chars N`` (the first N characters of each ``shakespeare_bpb`` work), ``--no-wandb``,
``--include-defaults`` (lm-eval's own task index, most of which needs the network).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint belongs to (``<run>/checkpoints/<file>``), if any."""
    run = checkpoint.parent.parent
    return run if checkpoint.parent.name == "checkpoints" and (run / "run_id").is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmlab.train.eval", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("ckpt", help="a .ckpt file, a sharded checkpoint folder or a run dir")
    parser.add_argument("--tasks", required=True, help="comma-separated task names")
    parser.add_argument("--limit", type=float, default=None, help="documents per task")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-chars", type=int, default=None)
    parser.add_argument("--no-wandb", action="store_true")
    parser.add_argument("--include-defaults", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from llmlab.train.evaluation.run import check_tasks
    from llmlab.train.export import checkpoint_path

    tasks = [t for t in args.tasks.split(",") if t]
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    try:
        check_tasks(tasks, args.include_defaults)
        checkpoint = checkpoint_path(args.ckpt)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from llmlab.train.evaluation.run import (
        evaluate,
        flat_metrics,
        log_to_wandb_run,
        table,
        write_json,
    )
    from llmlab.train.sample import load_checkpoint

    model, tokenizer = load_checkpoint(str(checkpoint))
    metadata = {"max_chars": args.max_chars} if args.max_chars else None
    results = evaluate(
        model, tokenizer, tasks, limit, args.batch_size, metadata, args.include_defaults
    )
    print(table(results))
    run = run_dir_of(checkpoint)
    out = (
        run / "eval" if run else checkpoint.parent
    ) / f"{checkpoint.name.removesuffix('.ckpt')}-eval.json"
    print(f"results: {write_json(results, out)}")
    if run is not None and not args.no_wandb:
        run_id = log_to_wandb_run(run, flat_metrics(results))
        print(f"logged to W&B run {run_id} ({run})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
