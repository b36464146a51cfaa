"""Building an llmlab model from a checkpoint's tensors: the one loading path that
``from_pretrained`` (a folder) and ``Llama.from_hf`` / ``GPT.from_hf_gpt2`` (a model in memory)
share. It imports no model class -- the caller passes it -- so the models can call it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from llmlab.models.hf.folder import CheckpointError
from llmlab.models.hf.names import is_inert_tensor, sources_for
from llmlab.models.hf.weights import Source, check_coverage, llmlab_shape, read_state_dict

USE_SETTINGS = ("block_size", "dropout", "kernels")  # chosen by the user, not the checkpoint


def make_config(config_cls: type, spec: Mapping[str, Any]) -> Any:
    config = config_cls(**{k: v for k, v in spec.items() if k != "arch"})
    config.validate()
    return config


def checkpoint_sources(checkpoint: Any, config: Any) -> dict[str, Source]:
    """The name map for ``config``, with GPT-2's prefix as the checkpoint spells it
    (``transformer.`` from ``GPT2LMHeadModel``, none from ``GPT2Model``)."""
    prefix = "transformer." if "transformer.wte.weight" in checkpoint.tensors else ""
    return sources_for(config, prefix, present=checkpoint.tensors)


def load_model(
    checkpoint: Any,
    spec: Mapping[str, Any],
    model_cls: type[nn.Module],
    config_cls: type,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """The model ``spec`` describes with every weight read from ``checkpoint`` (a
    :class:`CheckpointFolder`, or anything with its ``tensors``/``shape``/``read``/``dtype``),
    checked first: each tensor the config implies is there, and no tensor is left unread."""
    config = make_config(config_cls, spec)
    sources, model = check_checkpoint(checkpoint, config, model_cls)
    hf_tied = "lm_head.weight" if config.tie_embeddings else None  # HF ties it away on load
    dtype = dtype or checkpoint.dtype() or torch.float32
    state = _read_all(checkpoint, sources, config)
    if hf_tied in checkpoint.tensors:
        _check_tied_copy(checkpoint, state["embed." + _embedding_key(state)], hf_tied)
    params: dict[Source, nn.Parameter] = {}  # one Parameter per HF tensor: ties stay ties
    buffers = {n for n, _ in model.named_buffers()}
    for name, tensor in state.items():
        if name in buffers:  # e.g. a router's selection bias: a buffer, kept in fp32
            continue
        key = sources[name]
        if key not in params:
            params[key] = nn.Parameter(tensor.to(dtype=dtype), requires_grad=True)
        state[name] = params[key]
    model.load_state_dict(state, assign=True)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise CheckpointError(f"{checkpoint.path}: nothing loaded into {leftover[:3]}")
    return model


def check_checkpoint(
    checkpoint: Any, config: Any, model_cls: type[nn.Module]
) -> tuple[dict[str, Source], nn.Module]:
    """Headers against config, reading no weight: each tensor the config implies is there with
    its shape, and no tensor is left unread. Returns the name map and the model on ``meta``."""
    sources = checkpoint_sources(checkpoint, config)
    hf_tied = "lm_head.weight" if config.tie_embeddings else None  # HF ties it away on load
    check_coverage(checkpoint, sources, lambda n: is_inert_tensor(n, config) or n == hf_tied)
    with torch.device("meta"):
        model = model_cls(config)
    _check_shapes(checkpoint, sources, model)
    return sources, model


def _check_shapes(checkpoint: Any, sources: Mapping[str, Source], model: nn.Module) -> None:
    """Each tensor's shape against the model the config describes, from the headers alone (a
    shorter GPT position table may take the first rows of a longer one)."""
    for name, param in model.state_dict().items():
        have, want = llmlab_shape(checkpoint, sources[name]), tuple(param.shape)
        if name == "embed.wpe.weight" and have[0] >= want[0]:
            have = (want[0], *have[1:])
        if have != want:
            raise CheckpointError(
                f"{checkpoint.path}: tensor {sources[name].hf_name!r} has shape {list(have)} but "
                f"config.json implies {list(want)} (config and weights disagree)"
            )


def _embedding_key(state: Mapping[str, Tensor]) -> str:
    return "wte.weight" if "embed.wte.weight" in state else "tokens.weight"


def _check_tied_copy(checkpoint: Any, embedding: Tensor, name: str) -> None:
    """A tied checkpoint that also stores the LM head: HF would tie it away; refuse unless it
    is the embedding's copy (loading it either way would change the model)."""
    if not torch.equal(checkpoint.read(name), embedding):
        raise CheckpointError(
            f"{checkpoint.path}: config.json ties the LM head to the embeddings "
            f"(tie_word_embeddings) but holds tensor {name!r}, which differs from them"
        )


def _read_all(folder: Any, sources: Mapping[str, Source], config: Any) -> dict[str, Tensor]:
    state = read_state_dict(folder, {n: s for n, s in sources.items() if n != "embed.wpe.weight"})
    if "embed.wpe.weight" in sources:  # GPT: the first block_size rows of the position table
        rows = config.block_size
        state["embed.wpe.weight"] = folder.read(
            sources["embed.wpe.weight"].hf_name, (slice(0, rows),)
        )
    return state
