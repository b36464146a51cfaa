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


MAX_ID = 2**31 - 1  # ids index int32 arrays (the merge core, HF's encodings) and the embedding


def _bad_id(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID


def check_ids(data: dict[str, Any]) -> None:
    """Refuse ids that no model could use, naming the token and the id: not an integer in
    ``0..2**31-1``, one id for two tokens (``model.vocab`` or ``added_tokens``), an added token
    whose id differs from the vocabulary's, or ids so sparse that most of the range they span
    is unused (the embedding would be mostly rows no token reaches: a damaged file). Without
    this check such a file loads and encodes silently wrong (a negative id indexes from the
    end of the embedding) or builds a vocabulary of 10^12 entries.

    A Unigram ``vocab`` is a list, its ids implicit and so always well formed."""
    owner: dict[int, str] = {}  # id -> token
    ids_of: dict[str, int] = {}  # token -> id

    def claim(token: Any, value: Any, where: str) -> None:
        if _bad_id(value):
            raise ValueError(
                f"{where} token {token!r} has id {value!r}: ids must be integers in "
                f"0..{MAX_ID} (they index the embedding and int32 arrays)"
            )
        if token in ids_of and ids_of[token] != value:
            raise ValueError(
                f"{where} token {token!r} has id {value}, but the vocabulary gives it id "
                f"{ids_of[token]}"
            )
        if owner.get(value, token) != token:
            raise ValueError(f"{where} tokens {owner[value]!r} and {token!r} share id {value}")
        owner[value] = token
        ids_of[token] = value

    vocab = data["model"].get("vocab")
    if isinstance(vocab, dict):
        for token, value in vocab.items():
            claim(token, value, "model.vocab")
    added = data.get("added_tokens") or []
    if not isinstance(added, list):
        raise ValueError(f"added_tokens is a {type(added).__name__}, expected a list")
    for entry in added:
        if not isinstance(entry, dict) or "content" not in entry or "id" not in entry:
            raise ValueError(f"added_tokens entry {entry!r} lacks 'content' or 'id'")
        if isinstance(vocab, list) and not _bad_id(entry["id"]) and entry["id"] < len(vocab):
            continue  # a Unigram piece marked special: its id is its position in the list
        claim(entry["content"], entry["id"], "added_tokens")
    if owner and isinstance(vocab, dict):
        top = max(owner)
        if top + 1 > 2 * len(owner):
            raise ValueError(
                f"token {owner[top]!r} has id {top}, but there are only {len(owner)} tokens: "
                f"more than half of the ids 0..{top} belong to no token (ids must be "
                "(nearly) dense: they are the rows of the model's embedding)"
            )


def from_hf(data: dict[str, Any], path: Path, **options: Any) -> TokenizerBase:
    """The llmlab tokenizer of an HF ``tokenizer.json`` (already parsed into ``data``); its
    ids are checked first (:func:`check_ids`)."""
    try:
        name = family(data)
        check_ids(data)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise TokenizerFileError(path, str(exc)) from exc
    try:
        return TokenizerBase.registry[name].from_hf(data, path, **options)  # type: ignore[attr-defined]
    except TokenizerFileError:
        raise
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise TokenizerFileError(path, f"{name} tokenizer.json: {exc}") from exc
