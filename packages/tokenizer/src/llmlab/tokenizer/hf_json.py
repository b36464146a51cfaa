"""HF ``tokenizers``' ``tokenizer.json``: which llmlab class reads a given file.

Each class reads and writes its own files (``from_hf`` / ``to_hf``); this module only decides
the family. ``model.type`` says BPE, WordPiece or Unigram; a BPE file is

- end-of-word (character) BPE when its model has an ``end_of_word_suffix`` or a
  ``continuing_subword_prefix`` (GPT-1, CLIP, XLM, HF's ``CharBPETokenizer``);
- byte-level BPE when its pre-tokenizer maps bytes to characters (``ByteLevel``: GPT-2,
  Llama 3, Qwen, RoBERTa);
- SentencePiece BPE when it uses ``byte_fallback`` or marks spaces with ``▁`` (Llama 2,
  Mistral, Gemma, and every conversion of a SentencePiece BPE ``.model``);
- otherwise character BPE without a suffix (the end-of-word class, ``end_of_word_suffix=None``).

Anything a class does not support raises ``TokenizerFileError`` naming the field, rather than
loading a tokenizer that would encode differently from HF.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmlab.tokenizer.base import TokenizerBase
from llmlab.tokenizer.errors import TokenizerFileError
from llmlab.tokenizer.hf_components import flatten

SPACE = "▁"


def family(data: dict[str, Any]) -> str:
    """The llmlab model name (``TokenizerBase.registry`` key) that reads this file."""
    model = data["model"]
    kind = model.get("type")
    if kind is None:  # very old files have no type tag: guess from the fields
        kind = (
            "Unigram"
            if "unk_id" in model
            else "WordPiece"
            if "max_input_chars_per_word" in model
            else "BPE"
        )
    if kind == "WordPiece":
        return "wordpiece"
    if kind == "Unigram":
        return "unigram"
    if kind != "BPE":
        raise ValueError(
            f"model type {kind!r} is not supported (supported: BPE, WordPiece, Unigram)"
        )
    if model.get("end_of_word_suffix") or model.get("continuing_subword_prefix"):
        return "word_bpe"
    pre = flatten(data.get("pre_tokenizer"))
    if any(c.get("type") == "ByteLevel" for c in pre):
        return "bpe"
    marks_spaces = any(
        c.get("type") == "Metaspace"
        or (c.get("type") == "Prepend" and c.get("prepend") == SPACE)
        or (c.get("type") == "Replace" and c.get("content") == SPACE)
        for c in pre + flatten(data.get("normalizer"))
    )
    if model.get("byte_fallback") or marks_spaces:
        return "sentencepiece_bpe"
    return "word_bpe"


def from_hf(data: dict[str, Any], path: Path, **options: Any) -> TokenizerBase:
    """The llmlab tokenizer of an HF ``tokenizer.json`` (already parsed into ``data``)."""
    try:
        name = family(data)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise TokenizerFileError(path, str(exc)) from exc
    try:
        return TokenizerBase.registry[name].from_hf(data, path, **options)  # type: ignore[attr-defined]
    except TokenizerFileError:
        raise
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise TokenizerFileError(path, f"{name} tokenizer.json: {exc}") from exc
