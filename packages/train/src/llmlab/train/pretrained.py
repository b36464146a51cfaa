"""``model.init_from=<folder>``: start training from a Hugging Face-format checkpoint.

:func:`resolve_init_from` is the one step the app takes for it, before anything is built: it
opens the folder (``config.json`` read, every safetensors header checked against its file, the
shard index against the files present), turns the folder's ``config.json`` into llmlab model
fields (``llmlab.models.hf.pretrained_spec``: unsupported fields refused by name) and writes them
into ``cfg.model`` next to ``init_from``. From there the model config is an ordinary llmlab one
-- validated, checked against the layout on the meta device, saved in checkpoints' hyper-
parameters (so ``sample``, ``export`` and ``eval`` rebuild it without the folder) -- and
``llmlab.models.build_model`` reads the weights when the task builds the model (the whole model
in each process: one process or DDP). A missing shard, a truncated file or a config that
disagrees with the weights ends in one ``error:`` line naming the file, before any process group
exists.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

USE_KEYS = ("block_size", "dropout", "kernels")
log = logging.getLogger(__name__)


class InitFromError(ValueError):
    """A ``model.init_from`` folder or setting that cannot be used, reported before any work."""


def start_from_folder(cfg: DictConfig) -> None:
    """The app's step: :func:`resolve_init_from`, its refusals as :class:`InitFromError`."""
    try:
        spec = resolve_init_from(cfg)
    except ValueError as err:
        raise InitFromError(str(err)) from err
    if spec is not None:
        log.info("Model from %s: %s, %d layers", cfg.model.init_from, spec["arch"], spec["n_layer"])


def resolve_init_from(cfg: DictConfig) -> dict[str, Any] | None:
    """Fill ``cfg.model`` from ``cfg.model.init_from``'s ``config.json`` (module docstring);
    returns the new model fields, or ``None`` when the config does not start from a folder.
    Raises ``ValueError`` naming the bad file or field."""
    from llmlab.models.hf import check_pretrained

    model = cfg.get("model")
    if model is None or "init_from" not in model:
        return None
    if OmegaConf.is_missing(model, "init_from") or not model.init_from:
        raise ValueError(
            "model.init_from is required: the Hugging Face-format folder to start from "
            '(config.json + *.safetensors), e.g. ARGS="model.init_from=/models/Llama-3.2-1B"'
        )
    folder = str(model.init_from)
    use = {k: model[k] for k in USE_KEYS if model.get(k) is not None}
    spec = check_pretrained(folder, **use)  # every file present, whole and as config.json says
    given = {k: v for k, v in OmegaConf.to_container(model, resolve=True).items()
             if k not in (*USE_KEYS, "init_from")}  # fmt: skip
    for key, value in given.items():
        if key not in spec or spec[key] != value:
            raise ValueError(
                f"model.{key}={value!r}: with model.init_from the architecture comes from "
                f"{folder}/config.json ({key}={spec.get(key)!r}); only {', '.join(USE_KEYS)} "
                "may be set"
            )
    cfg.model = OmegaConf.create({"init_from": folder, **spec})
    return spec


def explain_tokenizer_error(cfg: DictConfig, message: str) -> str:
    """``message`` (a tokenizer that failed to load), plus what the file is when it is the
    ``model.init_from`` folder's SentencePiece-style ``tokenizer.json`` (Llama 2, Mistral: BPE
    over ``▁``-marked pieces with byte fallback), which ``llmlab.tokenizer`` may not read."""
    folder = OmegaConf.select(cfg, "model.init_from")
    path = OmegaConf.select(cfg, "tokenizer.path")
    if not folder or not path or Path(path).parent != Path(folder):
        return message
    try:
        spec = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return message
    if not isinstance(spec, dict):  # not a tokenizer.json at all: the message already says so
        return message
    text = json.dumps(
        [spec.get(k) for k in ("normalizer", "pre_tokenizer", "decoder")], ensure_ascii=False
    )
    model = spec.get("model") or {}
    if model.get("type") == "BPE" and (model.get("byte_fallback") or "\u2581" in text):
        return (
            f"{message} -- {path} is a SentencePiece-style BPE tokenizer (Llama 2 / Mistral: "
            "'\u2581' word marks, byte fallback) in a form llmlab.tokenizer does not read (the "
            "reason above); train with tokenizer=byte or tokenizer=bpe if its vocabulary fits the "
            "model's"
        )
    return message


def check_tokenizer_fits(cfg: DictConfig, tokenizer: Any) -> None:
    """A tokenizer whose ids reach past the model's embedding table would fail mid-step."""
    model = cfg.get("model")
    if tokenizer is None or model is None or not model.get("init_from"):
        return
    if tokenizer.vocab_size > model.vocab_size:
        raise InitFromError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but {model.init_from} embeds "
            f"{model.vocab_size}: use the folder's own tokenizer (tokenizer=pretrained)"
        )
