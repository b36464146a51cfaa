"""``python -m llmlab.train.export CKPT OUT_DIR``: a training checkpoint as a Hugging Face folder.

``CKPT`` is what ``llmlab.train`` leaves behind: a consolidated Lightning ``.ckpt``, the folder
of a sharded N-D checkpoint, or a run directory (its ``checkpoints/last.ckpt``). The model and
tokenizer are rebuilt as ``make sample`` rebuilds them (:func:`llmlab.train.sample.
load_checkpoint`), then ``llmlab.models.save_pretrained`` writes ``config.json``, the
safetensors weights (sharded above ``--max-shard-size``) and the tokenizer files, so that
``transformers``' ``AutoModelForCausalLM`` and ``AutoTokenizer`` load ``OUT_DIR`` with no custom
code (the tokenizer's bos/eos/pad ids, or ``null``, in ``config.json`` and
``generation_config.json``, so ``generate`` never falls back to an id outside the vocabulary).
``OUT_DIR`` must be new or empty unless ``--overwrite`` is given (``make export ... FORCE=1``):
exporting into a folder that already holds files would mix them with the export. A LoRA run's
checkpoint (``task.lora``) exports the merged model (``W + s·BA``, plain layers: what any HF
reader loads), or with ``--adapter`` (``make export ... ARGS=--adapter``) the adapters alone
as a peft folder (``adapter_config.json`` + ``adapter_model.safetensors``) for
``peft.PeftModel.from_pretrained`` over the base folder. A QLoRA run (``task.lora.quantize``)
exports merged by dequantizing its base first: the folder holds ``dequantize(W) + s·BA`` in
fp32, the function the run trained (its logits to fp32 rounding); requantizing the sum would
round most of the adapters' small update away (an int4 step is far larger than its entries),
and refusing would leave no folder a plain HF reader loads. Its ``--adapter`` export was
trained against the quantized base: ``PeftModel.from_pretrained`` over a dequantized copy of
that base reproduces the run, over the original float folder it is QLoRA's usual
approximation. This lives
in ``llmlab.train`` because only the app knows its checkpoint formats; the writing itself is
``llmlab.models``' (which never imports Lightning).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

USAGE = (
    "python -m llmlab.train.export CKPT OUT_DIR [--max-shard-size BYTES] [--dtype DTYPE] "
    "[--overwrite] [--adapter]"
)
DTYPES = ("float32", "bfloat16", "float16")


def checkpoint_path(path: str | Path) -> Path:
    """The checkpoint ``path`` names: itself, or a run directory's ``checkpoints/last.ckpt``."""
    from llmlab.parallel.checkpoint import checkpoint_problem

    path = Path(path)
    if path.is_dir() and (path / "checkpoints").is_dir():
        path = path / "checkpoints" / "last.ckpt"
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"{path} {problem}")
    return path


def check_out_dir(out_dir: str | Path, overwrite: bool = False) -> Path:
    """``out_dir`` if an export may write there: a new path or an empty folder, or any folder
    with ``overwrite`` (the export's files replace their namesakes, others stay). Checked before
    the checkpoint is read, so a wrong path costs nothing."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT_DIR {str(out)!r} is an existing file; name a folder (new or empty)")
    if out.is_dir() and not overwrite:
        entries = sorted(p.name for p in out.iterdir())
        if entries:
            raise ValueError(
                f"OUT_DIR {str(out)!r} is not empty ({len(entries)} entries, e.g. {entries[0]!r}): "
                "name a new or empty folder, or pass --overwrite (make export ... FORCE=1) to "
                "write the export's files into it"
            )
    return out


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
    ckpt: str | Path,
    out_dir: str | Path,
    max_shard_size: int = 5 * 10**9,
    dtype: str | None = None,
    overwrite: bool = False,
    adapter: bool = False,
) -> Path:
    """Write the checkpoint ``ckpt`` as an HF folder at ``out_dir``; returns ``out_dir``.
    ``overwrite``: allow a folder that already holds files (:func:`check_out_dir`).
    ``adapter``: a LoRA run's adapters as a peft folder instead of the merged model."""
    import torch

    from llmlab.models import save_pretrained
    from llmlab.train.sample import load_checkpoint

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {list(DTYPES)}")
    check_out_dir(out_dir, overwrite)
    model, tokenizer = load_checkpoint(str(checkpoint_path(ckpt)))
    from llmlab.models.lora import lora_layers, merge_and_unload, save_lora
    from llmlab.models.quantize import dequantize

    if adapter:
        if not lora_layers(model):
            raise ValueError(f"--adapter: {ckpt} is not a LoRA run's checkpoint (no task.lora)")
        return save_lora(model.to(getattr(torch, dtype)) if dtype else model, out_dir)
    model = dequantize(model)  # a QLoRA base in float layers: the adapters merge into them
    model = merge_and_unload(model)  # a LoRA run's adapters folded into plain layers
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    block = getattr(getattr(model, "config", None), "block_size", None)
    out = save_pretrained(model, out_dir, hf_tokenizer(tokenizer, block), max_shard_size)
    carry_chat_template(checkpoint_path(ckpt), Path(out))
    return out


def carry_chat_template(ckpt: Path, out_dir: Path) -> None:
    """The chat template of the folder the run's tokenizer came from (``chat_template.jinja``,
    or ``tokenizer_config.json``'s ``chat_template``) into the export's
    ``tokenizer_config.json``: a chat model trained with ``data=chat`` leaves with the template
    it was trained on (``AutoTokenizer.apply_chat_template``, a DPO run from the export).

    The special tokens that folder's ``tokenizer_config.json`` names (``eos_token``,
    ``bos_token``, ``pad_token``, ``unk_token``) come along too, and the ids of ``config.json``
    and ``generation_config.json`` follow them: a chat model whose turns end with
    ``<|im_end|>`` must stop there, where the export alone would guess ``<|endoftext|>`` from
    the token's spelling and decode past the end of its answer."""
    import torch

    if ckpt.is_dir():  # sharded: Lightning's state is the checkpoint's "extra"
        from llmlab.parallel.checkpoint import read_extra

        hp = (read_extra(ckpt) or {}).get("hyper_parameters", {})
    else:
        hp = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True).get(
            "hyper_parameters", {}
        )
    path = (hp.get("tokenizer") or {}).get("path")
    target = out_dir / "tokenizer_config.json"
    if not path or not target.is_file():
        return
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    source_config: dict[str, Any] = {}
    if (folder / "tokenizer_config.json").is_file():
        source_config = json.loads((folder / "tokenizer_config.json").read_text("utf-8"))
    source = source_config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    config = json.loads(target.read_text("utf-8"))
    roles = carried_special_tokens(source_config, out_dir / "tokenizer.json")
    if source is None and not roles:
        return
    if source is not None:
        config["chat_template"] = source
    config.update(roles)
    target.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")
    ids = {
        f"{role}_id": _token_id(out_dir / "tokenizer.json", token) for role, token in roles.items()
    }
    for name in ("config.json", "generation_config.json"):
        file = out_dir / name
        if file.is_file() and ids:
            fields = json.loads(file.read_text("utf-8"))
            fields.update({k: v for k, v in ids.items() if k in SPECIAL_ID_FIELDS})
            file.write_text(json.dumps(fields, indent=2) + "\n", "utf-8")


SPECIAL_ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")
SPECIAL_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def carried_special_tokens(source_config: dict[str, Any], tokenizer_json: Path) -> dict[str, str]:
    """``{role: token}`` of the special tokens a source ``tokenizer_config.json`` names (a
    string or ``{"content": ...}``) that the exported ``tokenizer.json`` holds."""
    roles = {}
    for role in SPECIAL_ROLES:
        value = source_config.get(role)
        token = value.get("content") if isinstance(value, dict) else value
        if isinstance(token, str) and _token_id(tokenizer_json, token) is not None:
            roles[role] = token
    return roles


def _token_id(tokenizer_json: Path, token: str) -> int | None:
    """The id of ``token`` in an HF ``tokenizer.json`` (its added tokens, then its model's
    vocabulary), or ``None``."""
    if not tokenizer_json.is_file():
        return None
    data = json.loads(tokenizer_json.read_text("utf-8"))
    for added in data.get("added_tokens") or []:
        if added.get("content") == token:
            return int(added["id"])
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and token in vocab:
        return int(vocab[token])
    if isinstance(vocab, list):  # Unigram: [piece, score] in id order
        for i, entry in enumerate(vocab):
            if entry and entry[0] == token:
                return i
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmlab.train.export", usage=USAGE,
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("ckpt", help="a .ckpt file, a sharded checkpoint folder or a run dir")
    parser.add_argument("out_dir", help="the HF-format folder to write")
    parser.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors file")
    parser.add_argument("--dtype", default=None, help=f"cast the weights: {', '.join(DTYPES)}")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into OUT_DIR even if it already holds files")  # fmt: skip
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run: its adapters as a peft folder, not merged")  # fmt: skip
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        size = parse_size(args.max_shard_size)
        out = export(args.ckpt, args.out_dir, size, args.dtype, args.overwrite, args.adapter)
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    size = sum((out / f).stat().st_size for f in files)
    print(f"wrote {out} ({size:,} bytes): {', '.join(files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
