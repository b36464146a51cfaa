"""``python -m llmlab.train.serve CKPT [serving options]`` (``make serve CKPT=...``): serve what
training left behind, CKPT taken as ``make export`` and ``make eval`` take it.

``CKPT`` may be a run directory (``outputs/<experiment>/<run>``: its ``checkpoints/last.ckpt``),
a ``.ckpt`` file, a sharded checkpoint folder, or an HF-format folder (``config.json``). The
first three are resolved and checked by :func:`llmlab.train.export.checkpoint_path`, the one
resolver export and eval use; then the serving CLI (``python -m llmlab.serving``) runs on the
result. A checkpoint inside a run directory is served under its experiment's name (``/v1/models``
lists ``gpt_shakespeare``, not ``last``) unless ``--served-model-name`` says otherwise.

This step lives in ``llmlab.train`` because only the app knows its run directories and
checkpoint formats; ``llmlab.serving`` imports neither ``llmlab.train`` nor
``llmlab.parallel`` (docs/architecture.md, "Serving: a separate engine"), so the resolution
happens here, in front of it.
"""

from __future__ import annotations

import sys
from pathlib import Path

USAGE = "python -m llmlab.train.serve CKPT [python -m llmlab.serving options]"


def experiment_of(checkpoint: Path) -> str | None:
    """The experiment a checkpoint was trained by, when it lies in a run directory: the
    ``experiment`` of the run's resolved ``config.yaml``, else the directory above the run
    (``outputs/<experiment>/<run>``); ``None`` for a checkpoint outside any run."""
    import yaml

    from llmlab.train.eval import run_dir_of

    run = run_dir_of(checkpoint)
    if run is None:
        return None
    config = run / "config.yaml"
    if config.is_file():
        try:
            name = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("experiment")
        except (yaml.YAMLError, AttributeError):
            name = None
        if isinstance(name, str) and name:
            return name
    return run.parent.name


def serving_argv(argv: list[str]) -> list[str]:
    """``argv`` for ``python -m llmlab.serving``: ``argv[0]`` (CKPT) resolved -- an HF folder
    as it is, anything else through :func:`~llmlab.train.export.checkpoint_path` -- and
    ``--served-model-name <experiment>`` added for a run's checkpoint unless one is given.
    Raises ``ValueError`` naming CKPT when it is no checkpoint."""
    from llmlab.train.export import checkpoint_path

    if not argv or argv[0].startswith("-"):
        raise ValueError(f"CKPT is required first: {USAGE}")
    model, options = Path(argv[0]), list(argv[1:])
    if model.is_dir() and (model / "config.json").is_file():
        return [str(model), *options]
    resolved = checkpoint_path(model)
    named = any(o == "--served-model-name" or o.startswith("--served-model-name=") for o in options)
    experiment = None if named else experiment_of(resolved)
    if experiment:
        options = ["--served-model-name", experiment, *options]
    return [str(resolved), *options]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        forwarded = serving_argv(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from llmlab.serving.__main__ import main as serve

    return serve(forwarded)


if __name__ == "__main__":
    raise SystemExit(main())
