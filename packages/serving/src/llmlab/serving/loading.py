"""``load(path)``: a model, its tokenizer and its chat template from what training left on disk.

Three forms of ``MODEL`` are told apart by what the path holds:

* **a training checkpoint** (a file): what ``llmlab.train`` saves -- ``hyper_parameters``
  with the model's config (``arch`` included) and the tokenizer's, and the weights under
  ``model.`` in ``state_dict``. ``llmlab.models.from_state_dict`` rebuilds the model; the
  byte tokenizer is rebuilt from the config, any other needs ``tokenizer=`` (a file
  ``llmlab.tokenizer.load`` reads: llmlab JSON, HF ``tokenizer.json``, ...), because the
  config only says how to *train* it again.
* **a sharded checkpoint folder** (DCP, with a ``.metadata`` index): refused with the command
  that turns it into a servable HF folder (``make export``) -- reading shards is the job of
  ``llmlab.train`` and ``llmlab.parallel``, and the serving engine imports neither.
* **an HF-format folder** (``config.json`` + weights): built by ``llmlab.models.from_pretrained``;
  the tokenizer from its ``tokenizer.json``, the chat template and eos from its
  ``tokenizer_config.json`` / ``chat_template.jinja`` / ``generation_config.json``.

Checkpoints are read with ``torch.load(weights_only=False)`` (they hold config objects):
serve only files you trust.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import torch

from llmlab.models import from_pretrained, from_state_dict
from llmlab.models.hf.folder import read_json
from llmlab.tokenizer import ByteTokenizer
from llmlab.tokenizer import load as load_tokenizer

BYTE_TOKENIZERS = {"llmlab.train.data.ByteTokenizer", "llmlab.tokenizer.ByteTokenizer"}


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: Any
    chat_template: str | None  # None: the tokenizer ships none
    eos_token_ids: list[int]
    name: str  # what /v1/models calls it
    template_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token text


def load(path: str | PathLike, tokenizer: Any = None) -> Loaded:
    """The model at ``path`` on CPU, in eval mode, with its tokenizer (see the module
    docstring). ``tokenizer``: a tokenizer object, or a path for ``llmlab.tokenizer.load``."""
    path = Path(path)
    if isinstance(tokenizer, (str, PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    if path.is_file():
        return _training_checkpoint(path, tokenizer)
    if (path / ".metadata").is_file():
        raise ValueError(
            f"{path} is a sharded (DCP) checkpoint folder, a format only llmlab.train and "
            f"llmlab.parallel read (the serving engine imports neither): export it as an "
            f"HF-format folder with `make export CKPT={path} OUT=<folder>` (python -m "
            f"llmlab.train.export) and serve that folder"
        )
    if (path / "config.json").is_file():
        return _hf_folder(path, tokenizer)
    if (path / "checkpoints").is_dir():  # resolving run directories is llmlab.train's job
        raise ValueError(
            f"{path} looks like a training run directory: serve it with `make serve "
            f"CKPT={path}` (python -m llmlab.train.serve), which resolves it to its last "
            f"checkpoint as export and eval do, or pass {path / 'checkpoints' / 'last.ckpt'}"
        )
    raise ValueError(
        f"MODEL {str(path)!r} is neither a training checkpoint file, a sharded checkpoint "
        f"folder (.metadata) nor an HF-format folder (config.json)"
    )


def _training_checkpoint(path: Path, tokenizer: Any) -> Loaded:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    hp = ckpt.get("hyper_parameters", {}) if isinstance(ckpt, dict) else {}
    if "model" not in hp or "state_dict" not in ckpt:
        raise ValueError(
            f"{path} is not an llmlab.train checkpoint: it needs hyper_parameters['model'] "
            f"(the model config) and a state_dict with the weights under 'model.'"
        )
    model = from_state_dict(hp["model"], ckpt["state_dict"], prefix="model.")
    if tokenizer is None:
        tokenizer = _tokenizer_from_spec(hp.get("tokenizer"), path)
    eos = getattr(tokenizer, "eos_token_id", None)
    return Loaded(model, tokenizer, None, [eos] if eos is not None else [], path.stem)


def _tokenizer_from_spec(spec: dict[str, Any] | None, path: Path) -> Any:
    target = (spec or {}).get("_target_")
    if spec is None or target in BYTE_TOKENIZERS:
        return ByteTokenizer()
    raise ValueError(
        f"{path} was trained with the tokenizer {target!r}, which its config cannot rebuild "
        f"without training it again; pass the saved tokenizer file (--tokenizer PATH, e.g. "
        f"the tokenizers/bpe-*.json cached under the run's cache dir), or serve the HF folder "
        f"`make export CKPT={path} OUT=<folder>` writes (it carries the tokenizer)"
    )


def _hf_folder(path: Path, tokenizer: Any) -> Loaded:
    model = from_pretrained(path).eval()
    if tokenizer is None:
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json; pass --tokenizer PATH")
        tokenizer = load_tokenizer(path / "tokenizer.json")
    config = _json(path / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    eos_ids = _eos_ids(path, config, tokenizer, model.config.vocab_size)
    texts = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
    return Loaded(model, tokenizer, template, eos_ids, path.name, texts)


def _eos_ids(path: Path, config: dict[str, Any], tokenizer: Any, vocab_size: int) -> list[int]:
    """The end-of-sequence ids, from the first of ``generation_config.json``, ``config.json``
    and ``tokenizer_config.json``'s ``eos_token`` that names one; each checked to be an id of
    the model's vocabulary, naming the file it came from (a wrong id would never stop
    generation, or stop it on an ordinary token)."""
    for name in ("generation_config.json", "config.json"):
        eos = _json(path / name).get("eos_token_id")
        if eos is not None:
            break
    if eos is None and isinstance(config.get("eos_token"), str):
        name = "tokenizer_config.json"
        eos = getattr(tokenizer, "token_to_id", lambda _: None)(config["eos_token"])
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise ValueError(
                f"{path / name}: eos_token_id {eos!r} is not an id of the model's vocabulary "
                f"(integers 0..{vocab_size - 1}, or a list of them)"
            )
    return list(ids)


def _token_text(entry: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(entry, dict):
        return str(entry.get("content", ""))
    return entry if isinstance(entry, str) else ""


def _json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, ``{}`` if there is no such file; malformed JSON or another
    kind of value is a ``ValueError`` naming the file (``llmlab.models``' reader)."""
    return read_json(path) if path.is_file() else {}


def encode(tokenizer: Any, text: str) -> list[int]:
    """``text``'s ids, with special-token text (e.g. a chat template's ``<|im_start|>``) read as
    the special token, as HF tokenizers do by default."""
    if getattr(tokenizer, "special_tokens", None):
        return list(tokenizer.encode(text, allowed_special="all"))
    return list(tokenizer.encode(text))
