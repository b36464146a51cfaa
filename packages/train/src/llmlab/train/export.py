"""``python -m llmlab.train.export CKPT OUT_DIR``: a training checkpoint as a Hugging Face folder.

``CKPT`` is what ``llmlab.train`` leaves behind: a consolidated Lightning ``.ckpt``, the folder
of a sharded N-D checkpoint, or a run directory (its ``checkpoints/last.ckpt``). The model and
tokenizer are rebuilt as ``make sample`` rebuilds them (:func:`llmlab.train.sample.
load_checkpoint`), then ``llmlab.models.save_pretrained`` writes ``config.json``, the
safetensors weights (sharded above ``--max-shard-size``) and the tokenizer files, so that
``transformers``' ``AutoModelForCausalLM`` and ``AutoTokenizer`` load ``OUT_DIR`` with no custom
code. This lives in ``llmlab.train`` because only the app knows its checkpoint formats; the
writing itself is ``llmlab.models``' (which never imports Lightning).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

USAGE = "python -m llmlab.train.export CKPT OUT_DIR [--max-shard-size BYTES] [--dtype DTYPE]"
DTYPES = ("float32", "bfloat16", "float16")


def checkpoint_path(path: str | Path) -> Path:
    """The checkpoint ``path`` names: itself, or a run directory's ``checkpoints/last.ckpt``."""
    from llmlab.train.checkpoints import checkpoint_problem

    path = Path(path)
    if path.is_dir() and (path / "checkpoints").is_dir():
        path = path / "checkpoints" / "last.ckpt"
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"{path} {problem}")
    return path


def hf_tokenizer(tokenizer: Any, model_max_length: int | None = None) -> Any:
    """An object with ``save_pretrained(folder)`` for a training tokenizer: the byte tokenizer
    as a 256-token byte-level BPE, llmlab's BPE / WordPiece / Unigram through their
    ``tokenizer.json``, an HF tokenizer as it is."""
    if callable(getattr(tokenizer, "save_pretrained", None)):
        return tokenizer
    from llmlab.tokenizer.hf_folder import HFTokenizerFiles

    if callable(getattr(tokenizer, "as_bpe", None)):
        tokenizer = tokenizer.as_bpe()
    return HFTokenizerFiles(tokenizer, model_max_length)


def parse_size(text: str) -> int:
    """``"5GB"``, ``"200MB"``, ``"30KB"`` or a plain number of bytes (decimal units, as HF)."""
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().isdigit():
            return int(upper[: -len(unit)]) * factor
    if upper.isdigit():
        return int(upper)
    raise ValueError(f"--max-shard-size {text!r} is not a size like 5GB, 200MB or 1000000")


def export(
    ckpt: str | Path, out_dir: str | Path, max_shard_size: int = 5 * 10**9, dtype: str | None = None
) -> Path:
    """Write the checkpoint ``ckpt`` as an HF folder at ``out_dir``; returns ``out_dir``."""
    import torch

    from llmlab.models import save_pretrained
    from llmlab.train.sample import load_checkpoint

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {list(DTYPES)}")
    model, tokenizer = load_checkpoint(str(checkpoint_path(ckpt)))
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    block = getattr(getattr(model, "config", None), "block_size", None)
    return save_pretrained(model, out_dir, hf_tokenizer(tokenizer, block), max_shard_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmlab.train.export", usage=USAGE,
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("ckpt", help="a .ckpt file, a sharded checkpoint folder or a run dir")
    parser.add_argument("out_dir", help="the HF-format folder to write")
    parser.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors file")
    parser.add_argument("--dtype", default=None, help=f"cast the weights: {', '.join(DTYPES)}")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = export(args.ckpt, args.out_dir, parse_size(args.max_shard_size), args.dtype)
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    size = sum((out / f).stat().st_size for f in files)
    print(f"wrote {out} ({size:,} bytes): {', '.join(files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
