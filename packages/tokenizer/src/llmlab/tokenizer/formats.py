"""One ``load(path)`` for every format, recognised from the file itself.

- ``llmlab``: readable JSON, ``{"format": "llmlab-tokenizer", "version": 1, "model": ...}``
  followed by the model's own fields (its ``to_dict``);
- HF ``tokenizer.json`` (``hf_json`` picks the family: byte-level, end-of-word or SentencePiece
  BPE, WordPiece, Unigram);
- a SentencePiece ``.model`` (BPE with or without byte fallback; needs the ``sentencepiece``
  package for its protobuf);
- ``.tiktoken`` ranks (plain or gzipped): the file has no pattern or special tokens, pass
  ``pattern=`` and ``special_tokens=``;
- ``vocab.json`` + ``merges.txt``: end-of-word BPE when the tokens carry ``</w>`` (GPT-1, XLM,
  subword-nmt), byte-level otherwise; GPT-2's ``encoder.json`` + ``vocab.bpe``. Pass either file
  or their folder.

Every failure names the file and what is wrong (``TokenizerFileError``). Writing is each
tokenizer's own ``save`` method; ``save(tok, path, format)`` here is the same call.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from llmlab.tokenizer import bpe_files, hf_json
from llmlab.tokenizer.base import FORMAT_TAG, FORMAT_VERSION, TokenizerBase
from llmlab.tokenizer.bpe import BPETokenizer
from llmlab.tokenizer.errors import TokenizerFileError
from llmlab.tokenizer.sp_bpe import SentencePieceBPETokenizer
from llmlab.tokenizer.unigram import UnigramTokenizer
from llmlab.tokenizer.word_bpe import WordBPETokenizer
from llmlab.tokenizer.wordpiece import WordPieceTokenizer

MODEL_CLASSES: tuple[type[TokenizerBase], ...] = (
    BPETokenizer,
    WordBPETokenizer,
    SentencePieceBPETokenizer,
    WordPieceTokenizer,
    UnigramTokenizer,
)
MODELS = {cls.model: cls for cls in MODEL_CLASSES}
SAVE_FORMATS = tuple(dict.fromkeys(f for cls in MODELS.values() for f in cls.save_formats))
FOLDER_FILES = ("tokenizer.json", "llmlab-tokenizer.json", "tokenizer.model")


def save(tok: TokenizerBase, path: str | Path, format: str = "llmlab") -> Path:
    """``tok.save(path, format)``: write ``tok`` in one of its ``save_formats``."""
    return tok.save(path, format)


def load(path: str | Path, **options: Any) -> TokenizerBase:
    """Read any supported tokenizer file (or folder) and return the matching tokenizer.

    ``options`` go to the tokenizer (``backend=``) or supply what the file lacks (``pattern=``
    and ``special_tokens=`` for ``.tiktoken`` ranks).
    """
    path = Path(path)
    if not path.exists():
        raise TokenizerFileError(path, "no such file or directory")
    if path.is_dir():
        return _load_dir(path, options)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise TokenizerFileError(path, f"damaged gzip data: {exc}") from exc
    if not raw.strip():
        raise TokenizerFileError(path, "the file is empty")
    if path.suffix == ".model" or raw[:1] == b"\n":  # a protobuf starting with field 1 (pieces)
        return SentencePieceBPETokenizer.from_sentencepiece_file(path, **options)
    if raw.lstrip()[:1] in (b"{", b"["):
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TokenizerFileError(path, f"damaged JSON: {exc}") from exc
        return _load_json(path, data, options)
    return _load_tiktoken(path, raw, options)


def _load_dir(path: Path, options: dict[str, Any]) -> TokenizerBase:
    for name in FOLDER_FILES:
        if (path / name).is_file():
            return load(path / name, **options)
    for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (path / vocab).is_file() and (path / merges).is_file():
            return load_vocab_merges(path / vocab, path / merges, **options)
    raise TokenizerFileError(
        path,
        f"folder holds none of {', '.join(FOLDER_FILES)}, vocab.json + merges.txt, "
        "encoder.json + vocab.bpe",
    )


def _load_json(path: Path, data: Any, options: dict[str, Any]) -> TokenizerBase:
    if isinstance(data, dict) and data.get("format") == FORMAT_TAG:
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise TokenizerFileError(
                path, f"llmlab format version {version!r} is not supported (expected 1)"
            )
        model = data.get("model")
        if model not in MODELS:
            raise TokenizerFileError(
                path, f"unknown model {model!r}; valid models: {', '.join(MODELS)}"
            )
        try:
            return MODELS[model].from_dict(data, **options)
        except (KeyError, ValueError, TypeError) as exc:
            raise TokenizerFileError(path, f"damaged llmlab {model} data: {exc!r}") from exc
    if isinstance(data, dict) and "model" in data and isinstance(data["model"], dict):
        return hf_json.from_hf(data, path, **options)
    if isinstance(data, dict) and data and all(isinstance(v, int) for v in data.values()):
        for merges in ("merges.txt", "vocab.bpe"):
            if path.with_name(merges).is_file():
                return load_vocab_merges(path, path.with_name(merges), **options)
        raise TokenizerFileError(
            path,
            "looks like a vocab.json / encoder.json, but no merges.txt or vocab.bpe is next to it",
        )
    raise TokenizerFileError(
        path, "JSON is neither an llmlab tokenizer, an HF tokenizer.json, nor a vocab.json"
    )


def _load_tiktoken(path: Path, raw: bytes, options: dict[str, Any]) -> BPETokenizer:
    ranks = bpe_files.read_tiktoken(path, raw)
    if "pattern" not in options:
        raise TokenizerFileError(
            path,
            ".tiktoken files carry no pre-tokenization pattern: pass pattern= "
            "('gpt2', 'gpt4', 'o200k' or a regex) and special_tokens= to load()",
        )
    try:
        return BPETokenizer(ranks, **options)
    except ValueError as exc:
        raise TokenizerFileError(path, str(exc)) from exc


def load_vocab_merges(vocab: str | Path, merges: str | Path, **options: Any) -> TokenizerBase:
    """A ``vocab.json`` + ``merges.txt`` pair: end-of-word BPE when its tokens end in ``</w>``,
    else byte-level (GPT-2's ``encoder.json`` + ``vocab.bpe`` are the same format)."""
    vocab, merges = Path(vocab), Path(merges)
    text = vocab.read_text(encoding="utf-8")
    if WordBPETokenizer.DEFAULT_SUFFIX in text:
        return WordBPETokenizer.from_vocab_merges(vocab, merges, **options)
    fields = bpe_files.read_gpt2(vocab, merges)
    return BPETokenizer(**{**fields, **options})


def load_gpt2(encoder_json: str | Path, vocab_bpe: str | Path, **options: Any) -> BPETokenizer:
    """GPT-2's files: ``encoder.json`` (token string -> id) and ``vocab.bpe`` (merges)."""
    fields = bpe_files.read_gpt2(Path(encoder_json), Path(vocab_bpe))
    return BPETokenizer(**{**fields, **options})
