"""Saving and loading: one ``load(path)`` that recognises the format.

Formats:

- ``llmlab``: readable JSON, ``{"format": "llmlab-tokenizer", "version": 1, "model": ...}``
  followed by the model's own fields (vocab as HF-style strings, merges, scores...);
- ``hf``: HF ``tokenizers``' ``tokenizer.json`` for BPE (ByteLevel), WordPiece (BERT) and
  Unigram (Metaspace) — see ``hf_json``;
- ``tiktoken``: ``base64(token) rank`` lines (BPE only; optionally gzipped on read). The file has
  no pattern or special tokens: pass ``pattern=`` and ``special_tokens=`` to ``load``;
- GPT-2's ``encoder.json`` + ``vocab.bpe`` (read only): pass either file or their folder.

Every failure names the file and what is wrong (``TokenizerFileError``). ``save`` and ``load``
are functions here rather than methods of the tokenizers because this module needs every model
class; a method would make the models import it back.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import json
from pathlib import Path
from typing import Any

from llmlab.tokenizer import hf_json
from llmlab.tokenizer.base import TokenizerBase
from llmlab.tokenizer.bpe import BPETokenizer
from llmlab.tokenizer.byte_level import token_string_to_bytes
from llmlab.tokenizer.errors import TokenizerFileError
from llmlab.tokenizer.unigram import UnigramTokenizer
from llmlab.tokenizer.wordpiece import WordPieceTokenizer

FORMAT_TAG = "llmlab-tokenizer"
FORMAT_VERSION = 1
SAVE_FORMATS = ("llmlab", "hf", "tiktoken")
MODELS: dict[str, type[TokenizerBase]] = {
    "bpe": BPETokenizer,
    "wordpiece": WordPieceTokenizer,
    "unigram": UnigramTokenizer,
}


def save(tok: TokenizerBase, path: str | Path, format: str = "llmlab") -> Path:
    """Write ``tok`` to ``path`` as ``format``: "llmlab" (readable JSON), "hf" (HF
    ``tokenizer.json``) or, for BPE, "tiktoken" (base64 ranks); returns the path."""
    path = Path(path)
    if format not in SAVE_FORMATS:
        raise ValueError(f"unknown format {format!r}; valid formats: {', '.join(SAVE_FORMATS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if format == "llmlab":
        payload = {"format": FORMAT_TAG, "version": FORMAT_VERSION, "model": tok.model}
        payload.update(tok.to_dict())
        path.write_text(json.dumps(payload, ensure_ascii=False, indent=1), encoding="utf-8")
    elif format == "hf":
        path.write_text(json.dumps(hf_json.to_hf(tok), ensure_ascii=False), encoding="utf-8")
    else:
        if tok.model != "bpe":
            raise ValueError(f"format 'tiktoken' holds BPE ranks only, not a {tok.model} model")
        lines = [
            f"{base64.b64encode(t).decode('ascii')} {r}\n"
            for t, r in sorted(tok.ranks.items(), key=lambda kv: kv[1])
        ]
        path.write_text("".join(lines), encoding="ascii")
    return path


def load(path: str | Path, **options: Any) -> TokenizerBase:
    """Read any supported tokenizer file and return the matching llmlab tokenizer.

    ``options`` go to the tokenizer (``backend=``) or supply what the file lacks
    (``pattern=`` and ``special_tokens=`` for ``.tiktoken`` ranks).
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
    if raw.lstrip()[:1] in (b"{", b"["):
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TokenizerFileError(path, f"damaged JSON: {exc}") from exc
        return _load_json(path, data, options)
    return _load_tiktoken(path, raw, options)


def _load_dir(path: Path, options: dict[str, Any]) -> Any:
    for name in ("tokenizer.json", "llmlab-tokenizer.json"):
        if (path / name).is_file():
            return load(path / name, **options)
    if (path / "encoder.json").is_file() and (path / "vocab.bpe").is_file():
        return load_gpt2(path / "encoder.json", path / "vocab.bpe", **options)
    raise TokenizerFileError(
        path, "folder holds no tokenizer.json, llmlab-tokenizer.json, or encoder.json + vocab.bpe"
    )


def _load_json(path: Path, data: Any, options: dict[str, Any]) -> Any:
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
        bpe = path.with_name("vocab.bpe")
        if not bpe.is_file():
            raise TokenizerFileError(
                path, "looks like GPT-2's encoder.json but vocab.bpe is not next to it"
            )
        return load_gpt2(path, bpe, **options)
    raise TokenizerFileError(
        path, "JSON is neither an llmlab tokenizer, an HF tokenizer.json, nor GPT-2's encoder.json"
    )


def _load_tiktoken(path: Path, raw: bytes, options: dict[str, Any]) -> BPETokenizer:
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError("expected 'base64token rank'")
            ranks[base64.b64decode(fields[0], validate=True)] = int(fields[1])
        except (ValueError, binascii.Error) as exc:
            shown = line[:60].decode("utf-8", "replace")
            raise TokenizerFileError(
                path,
                f"line {lineno} is not '<base64 token> <rank>' (.tiktoken format): {shown!r}",
            ) from exc
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


def load_gpt2(encoder_json: str | Path, vocab_bpe: str | Path, **options: Any) -> BPETokenizer:
    """GPT-2's files: ``encoder.json`` (token string -> id) and ``vocab.bpe`` (merges)."""
    encoder_json, vocab_bpe = Path(encoder_json), Path(vocab_bpe)
    try:
        encoder = json.loads(encoder_json.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerFileError(encoder_json, f"damaged JSON: {exc}") from exc
    specials = {t: i for t, i in encoder.items() if t.startswith("<|") and t.endswith("|>")}
    ranks = {}
    for token, i in encoder.items():
        if token in specials:
            continue
        try:
            ranks[token_string_to_bytes(token)] = i
        except KeyError as exc:
            raise TokenizerFileError(
                encoder_json, f"token {token!r} is not spelled with GPT-2's byte alphabet"
            ) from exc
    lines = vocab_bpe.read_text(encoding="utf-8").splitlines()
    merge_lines = (
        [ln for ln in lines[1:] if ln.strip()]
        if lines[:1] and lines[0].startswith("#version")
        else [ln for ln in lines if ln.strip()]
    )
    merges = []
    for lineno, line in enumerate(merge_lines, start=2):
        parts = line.split(" ")
        if len(parts) != 2:
            raise TokenizerFileError(vocab_bpe, f"line {lineno} is not a merge 'left right'")
        left, right = (ranks.get(token_string_to_bytes(p)) for p in parts)
        if left is None or right is None:
            raise TokenizerFileError(
                vocab_bpe, f"line {lineno}: merge {line!r} uses unknown tokens"
            )
        merges.append((left, right))
    if len(merges) != len(ranks) - 256:
        raise TokenizerFileError(
            vocab_bpe,
            f"{len(merges)} merges but encoder.json has {len(ranks) - 256} non-byte tokens",
        )
    options.setdefault("pattern", "gpt2")
    options.setdefault("special_tokens", specials)
    return BPETokenizer(ranks, merges=merges, **options)
