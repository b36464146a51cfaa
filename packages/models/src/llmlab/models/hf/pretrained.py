"""``from_pretrained`` and ``save_pretrained``: HF-format folders in and out, no ``transformers``.

Loading builds the llmlab model on the ``meta`` device (its shape, no memory, no random init),
reads the tensors it needs with ``safetensors`` (:mod:`llmlab.models.hf.weights`) and assigns
them, tied embeddings staying tied. :func:`read_weights` is the same reading for a subset of the
parameters and for slices of them -- what a pipeline stage or a tensor-parallel rank needs.

Saving is the inverse: ``config.json`` for the ``transformers`` class that computes the same
function (:mod:`llmlab.models.hf.configs`) with the tokenizer's bos/eos/pad ids (also in
``generation_config.json``), the tensors under HF's names and layouts in
``model.safetensors`` -- or in shards of at most ``max_shard_size`` bytes with
``model.safetensors.index.json`` -- and, given a tokenizer, its files. Every file is written
under a temporary name and renamed into place, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from llmlab.models.gpt import GPT, GPTConfig
from llmlab.models.hf.configs import from_hf_config, to_hf_config
from llmlab.models.hf.folder import (
    CONFIG,
    INDEX,
    SINGLE,
    CheckpointError,
    CheckpointFolder,
    read_json,
)
from llmlab.models.hf.loading import (
    USE_SETTINGS,
    check_checkpoint,
    checkpoint_sources,
    load_model,
    make_config,
)
from llmlab.models.hf.names import sources_for
from llmlab.models.hf.weights import Shard, read_state_dict, to_hf_tensors
from llmlab.models.llama import Llama
from llmlab.models.llama_config import LlamaConfig

MODELS: dict[str, tuple[type[nn.Module], type]] = {
    "gpt": (GPT, GPTConfig),
    "llama": (Llama, LlamaConfig),
}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3  # transformers' default: 5 GB per file
GENERATION = "generation_config.json"


def pretrained_spec(path: str | Path, **use: Any) -> dict[str, Any]:
    """The llmlab model spec (``{"arch": ..., fields}``, as ``build_model`` takes it) of the
    folder at ``path``; ``use`` sets ``block_size`` (at most the checkpoint's), ``dropout`` and
    ``kernels``. Reads ``config.json`` only; every unsupported field is refused by name."""
    path = Path(path)
    hf = read_json(path / CONFIG)
    arch, fields = from_hf_config(hf, str(path / CONFIG))
    unknown = sorted(set(use) - set(USE_SETTINGS))
    if unknown:
        raise ValueError(f"from_pretrained: {unknown[0]!r} is not a setting; valid: {USE_SETTINGS}")
    block = use.get("block_size")
    if block is not None and block > fields["block_size"]:
        raise ValueError(
            f"block_size={block} exceeds the {fields['block_size']} positions {path / CONFIG} "
            "was trained for"
        )
    fields.update({k: v for k, v in use.items() if v is not None})
    spec = {"arch": arch, **fields}
    try:
        make_config(MODELS[arch][1], spec)
    except ValueError as err:  # e.g. an unimplemented RoPE scaling: name the file
        raise CheckpointError(f"{path / CONFIG}: {err}") from err
    return spec


def check_pretrained(path: str | Path, **use: Any) -> dict[str, Any]:
    """The spec of the folder at ``path`` once every file is checked against its
    ``config.json`` -- shards present, files whole, every tensor there with its shape, none
    left over -- without reading a weight: what to call before starting processes."""
    spec = pretrained_spec(path, **use)
    model_cls, config_cls = MODELS[spec["arch"]]
    check_checkpoint(CheckpointFolder(path), make_config(config_cls, spec), model_cls)
    return spec


def read_weights(
    folder: CheckpointFolder | str | Path,
    config: GPTConfig | LlamaConfig,
    names: Iterable[str] | None = None,
    shards: Mapping[str, Shard] | None = None,
) -> dict[str, Tensor]:
    """llmlab tensors ``names`` (default: all) of the checkpoint, each whole or, for the names
    in ``shards``, only that :class:`Shard` -- reading only those bytes from the files.

    ``llmlab.models.hf.weights.tensor_parallel_shards(model.tensor_parallel_plan(), names,
    rank, world)`` gives a tensor-parallel rank's shards; a pipeline stage passes its layers'
    names. ``folder.bytes_read`` counts what was read.
    """
    if not isinstance(folder, CheckpointFolder):
        folder = CheckpointFolder(folder)
    return read_state_dict(folder, checkpoint_sources(folder, config), names, shards)


def from_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    **use: Any,
) -> nn.Module:
    """llmlab's ``GPT`` or ``Llama`` with the config and weights of the HF folder at ``path``
    (``config.json`` + ``model.safetensors``, or shards with ``model.safetensors.index.json``),
    or of a llama.cpp GGUF file of the Llama family (``path`` ending in ``.gguf``, see
    :mod:`llmlab.models.gguf`).

    ``dtype``: the parameters' dtype (default: the dtype the weights are stored in).
    ``device="meta"`` builds the shape only, reading no weight. ``use``: ``block_size``,
    ``dropout``, ``kernels`` (see :func:`pretrained_spec`); a GPT with a smaller
    ``block_size`` keeps the first rows of its position table (exact for such sequences).
    """
    if str(path).endswith(".gguf"):
        from llmlab.models.gguf import from_gguf

        model = from_gguf(path, dtype=dtype, **use)
        return model.to(device) if device is not None else model
    spec = pretrained_spec(path, **use)
    model_cls, config_cls = MODELS[spec["arch"]]
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            return model_cls(make_config(config_cls, spec)).to(dtype=dtype or torch.float32)
    model = load_model(CheckpointFolder(path), spec, model_cls, config_cls, dtype)
    return model.to(device) if device is not None else model


# --------------------------------------------------------------------------- saving
def save_pretrained(
    model: nn.Module,
    out_dir: str | Path,
    tokenizer: Any = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write ``model`` (an llmlab ``GPT`` or ``Llama``, whole) as an HF-format folder that
    ``transformers.AutoModelForCausalLM.from_pretrained`` and :func:`from_pretrained` load.

    ``tokenizer``: anything with ``save_pretrained(out_dir)`` (an HF tokenizer, or an llmlab
    tokenizer wrapped by ``llmlab.tokenizer.hf_folder.HFTokenizerFiles``); its
    ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` (:func:`special_token_ids`) go into
    ``config.json`` and ``generation_config.json``. Without a tokenizer no token id is written
    (nothing is known about them). Files above
    ``max_shard_size`` bytes are split into shards with an index. Returns ``out_dir``.
    """
    config = getattr(model, "config", None)
    if not isinstance(config, GPTConfig | LlamaConfig):
        raise TypeError(f"save_pretrained takes an llmlab GPT or Llama, got {type(model).__name__}")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(
            f"tokenizer {type(tokenizer).__name__} has no save_pretrained(out_dir); wrap an "
            "llmlab tokenizer in llmlab.tokenizer.hf_folder.HFTokenizerFiles(tok)"
        )
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size}")
    tensors = _hf_tensors(model, config)
    # buffers kept in fp32 whatever the weights' dtype (a router's selection bias, as
    # transformers keeps DeepSeek-V3's e_score_correction_bias) do not set the folder's dtype
    fp32_buffers = _fp32_buffer_names(model, config)
    dtypes = {t.dtype for n, t in tensors.items() if n not in fp32_buffers}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPE_NAMES:
        raise ValueError(
            f"save_pretrained needs one float dtype of {list(DTYPE_NAMES)}, got {dtypes}"
        )
    hf_config = to_hf_config(config, DTYPE_NAMES[next(iter(dtypes))])
    token_ids = special_token_ids(tokenizer, config.vocab_size) if tokenizer is not None else {}
    hf_config.update(token_ids)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is an existing file, not a folder: name a folder to write into")
    out.mkdir(parents=True, exist_ok=True)
    files = _shard(tensors, max_shard_size)
    keep = {*files, CONFIG} | ({INDEX} if len(files) > 1 else set())
    for file, names in files.items():
        _atomic(out / file, lambda p, names=names: _save_file({n: tensors[n] for n in names}, p))
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {n: f for f, names in files.items() for n in names},
        }
        _atomic(out / INDEX, lambda p: p.write_text(json.dumps(index, indent=2) + "\n"))
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:
        if stale.exists() and stale.name not in keep:
            stale.unlink()  # a previous export's weights, not part of this one
    _atomic(out / CONFIG, lambda p: p.write_text(json.dumps(hf_config, indent=2) + "\n"))
    if tokenizer is not None:
        generation = dict(token_ids)
        if generation["pad_token_id"] is None:  # what generate() would pick, with a warning
            generation["pad_token_id"] = token_ids["eos_token_id"]
        _atomic(out / GENERATION, lambda p: p.write_text(json.dumps(generation, indent=2) + "\n"))
        tokenizer.save_pretrained(str(out))
    return out


def special_token_ids(tokenizer: Any, vocab_size: int) -> dict[str, int | None]:
    """``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` of ``tokenizer`` (HF's attribute
    names; ``None`` where it has no such token), each checked to be an
    id of the model's vocabulary.

    They are written explicitly, ``null`` included, because a ``config.json`` without them
    gets the ``transformers`` class's defaults: GPT-2's 50256 (outside a small vocabulary, so
    ``generate`` warns and can never stop) or Llama's 1 and 2 (bytes of the byte tokenizer).
    """
    ids: dict[str, int | None] = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key, None)
        if value is not None and not (isinstance(value, int) and 0 <= value < vocab_size):
            raise ValueError(
                f"the tokenizer's {key}={value!r} is not an id of the model's vocabulary "
                f"(0..{vocab_size - 1}): tokenizer and model disagree"
            )
        ids[key] = value
    return ids


def _fp32_buffer_names(model: nn.Module, config: Any) -> set[str]:
    sources = sources_for(config)
    return {
        sources[n].hf_name
        for n, b in model.named_buffers()
        if n in sources and b.dtype == torch.float32
    }


def _hf_tensors(model: nn.Module, config: Any) -> dict[str, Tensor]:
    state = model.state_dict()
    sources = sources_for(config)
    missing = sorted(set(sources) - set(state))
    if missing:
        raise ValueError(
            f"save_pretrained needs the whole model; it lacks {missing[:3]} (a pipeline stage or "
            "a sharded model: consolidate it first)"
        )
    out: dict[str, Tensor] = {}
    for name, source in sources.items():
        if source.hf_name not in out:  # a tied LM head is the embedding, written once
            tensor = state[name].detach().to("cpu")
            out.update({n: t.clone() for n, t in to_hf_tensors(source, tensor).items()})
    return out


def _shard(tensors: Mapping[str, Tensor], limit: int) -> dict[str, list[str]]:
    """File name -> tensor names, in order, each file at most ``limit`` bytes (a larger tensor
    gets a file of its own); one file is ``model.safetensors``."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        n = tensor.numel() * tensor.element_size()
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    if len(groups) == 1:
        return {SINGLE: groups[0]}
    total = len(groups)
    return {f"model-{i + 1:05d}-of-{total:05d}.safetensors": g for i, g in enumerate(groups)}


def _save_file(tensors: dict[str, Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _atomic(path: Path, write: Any) -> None:
    """``write(tmp)`` then rename onto ``path``: readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as any new file (safetensors creates it private)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
