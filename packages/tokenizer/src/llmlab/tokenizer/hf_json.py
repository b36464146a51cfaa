"""HF ``tokenizers``' ``tokenizer.json``: read and write for BPE, WordPiece and Unigram.

Only the pipelines that these models use in practice are understood; anything else raises a
``TokenizerFileError`` naming the component, rather than loading a tokenizer that would encode
differently from HF.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmlab.tokenizer.bpe import BPETokenizer
from llmlab.tokenizer.byte_level import bytes_to_token_string, token_string_to_bytes
from llmlab.tokenizer.errors import TokenizerFileError
from llmlab.tokenizer.patterns import HF_BYTELEVEL_PATTERN, to_onig
from llmlab.tokenizer.unigram import UnigramTokenizer
from llmlab.tokenizer.wordpiece import WordPieceTokenizer


def _added(content: str, i: int, special: bool = True) -> dict[str, Any]:
    return {
        "id": i,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _skeleton() -> dict[str, Any]:
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": None,
        "model": None,
    }


def to_hf(tok: Any) -> dict[str, Any]:
    return {"bpe": _bpe_to_hf, "wordpiece": _wordpiece_to_hf, "unigram": _unigram_to_hf}[tok.model](
        tok
    )


def from_hf(data: dict[str, Any], path: Path, **options: Any) -> Any:
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
    readers = {"BPE": _bpe_from_hf, "WordPiece": _wordpiece_from_hf, "Unigram": _unigram_from_hf}
    if kind not in readers:
        raise TokenizerFileError(
            path, f"model type {kind!r} is not supported (supported: {', '.join(readers)})"
        )
    try:
        return readers[kind](data, path, **options)
    except TokenizerFileError:
        raise
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise TokenizerFileError(path, f"damaged {kind} tokenizer.json: {exc!r}") from exc


# --------------------------------------------------------------------------- BPE
def _bpe_to_hf(tok: Any) -> dict[str, Any]:
    out = _skeleton()
    out["added_tokens"] = [
        _added(s, i) for s, i in sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    ]
    out["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": to_onig(tok.pattern)},
                "behavior": "Isolated",
                "invert": False,
            },
            {
                "type": "ByteLevel",
                "add_prefix_space": tok.add_prefix_space,
                "trim_offsets": True,
                "use_regex": False,
            },
        ],
    }
    out["decoder"] = {
        "type": "ByteLevel",
        "add_prefix_space": True,
        "trim_offsets": True,
        "use_regex": True,
    }
    vocab = {s: i for s, i in tok.special_tokens.items()}
    vocab.update({bytes_to_token_string(t): i for t, i in tok.ranks.items()})
    spell = {i: bytes_to_token_string(t) for t, i in tok.ranks.items()}
    out["model"] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        # tiktoken's rule: a chunk that is itself a token is kept whole. For vocabularies made by
        # merging this never changes the result, and it makes HF follow llmlab exactly.
        "ignore_merges": True,
        "vocab": dict(sorted(vocab.items(), key=lambda kv: kv[1])),
        "merges": [[spell[a], spell[b]] for a, b in tok.merges],
    }
    return out


def _bpe_pre_tokenizer(pre: Any, path: Path) -> tuple[str, bool]:
    """(regex, add_prefix_space) from a ByteLevel or Split+ByteLevel pre-tokenizer."""
    if pre is None:
        raise TokenizerFileError(path, "BPE without a pre-tokenizer is not a byte-level BPE")
    if pre["type"] == "ByteLevel":
        if not pre.get("use_regex", True):
            raise TokenizerFileError(
                path, "ByteLevel pre-tokenizer without a regex split is not supported"
            )
        return HF_BYTELEVEL_PATTERN, bool(pre.get("add_prefix_space", False))
    if pre["type"] == "Sequence":
        steps = pre["pretokenizers"]
        if (
            len(steps) == 2
            and steps[0]["type"] == "Split"
            and steps[0].get("behavior") == "Isolated"
            and not steps[0].get("invert", False)
            and "Regex" in steps[0]["pattern"]
            and steps[1]["type"] == "ByteLevel"
            and not steps[1].get("use_regex", True)
        ):
            return steps[0]["pattern"]["Regex"], bool(steps[1].get("add_prefix_space", False))
    raise TokenizerFileError(
        path,
        f"pre-tokenizer {pre.get('type')!r} is not supported for BPE (supported: ByteLevel, or "
        "Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)])",
    )


def _bpe_from_hf(data: dict[str, Any], path: Path, **options: Any) -> Any:
    if data.get("normalizer") is not None:
        raise TokenizerFileError(
            path,
            f"normalizer {data['normalizer'].get('type')!r} is not supported for byte-level BPE",
        )
    model = data["model"]
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise TokenizerFileError(path, f"BPE {key}={model[key]!r} is not supported")
    if model.get("dropout"):
        raise TokenizerFileError(path, "BPE dropout is not supported (encoding would be random)")
    pattern, add_prefix_space = _bpe_pre_tokenizer(data.get("pre_tokenizer"), path)
    specials = {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
    special_ids = set(specials.values())
    ranks: dict[bytes, int] = {}
    for token, i in model["vocab"].items():
        if i in special_ids:
            continue
        try:
            ranks[token_string_to_bytes(token)] = int(i)
        except KeyError as exc:
            raise TokenizerFileError(
                path, f"vocab token {token!r} is not spelled with the byte-level alphabet"
            ) from exc
    merges = []
    by_string = model["vocab"]
    for m in model.get("merges", []):
        left, right = m.split(" ") if isinstance(m, str) else m
        merges.append((by_string[left], by_string[right]))
    options.setdefault("pattern", pattern)
    options.setdefault("special_tokens", specials)
    options.setdefault("add_prefix_space", add_prefix_space)
    try:
        return BPETokenizer(ranks, merges=merges, **options)
    except ValueError as exc:
        raise TokenizerFileError(path, str(exc)) from exc


# --------------------------------------------------------------------------- WordPiece
def _wordpiece_to_hf(tok: Any) -> dict[str, Any]:
    out = _skeleton()
    out["added_tokens"] = [
        _added(s, i) for s, i in sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    ]
    out["normalizer"] = {
        "type": "BertNormalizer",
        "clean_text": tok.clean_text,
        "handle_chinese_chars": tok.handle_chinese_chars,
        "strip_accents": tok.strip_accents,
        "lowercase": tok.lowercase,
    }
    out["pre_tokenizer"] = {"type": "BertPreTokenizer"}
    if "[CLS]" in tok.vocab and "[SEP]" in tok.vocab:
        out["post_processor"] = {
            "type": "BertProcessing",
            "sep": ["[SEP]", tok.vocab["[SEP]"]],
            "cls": ["[CLS]", tok.vocab["[CLS]"]],
        }
    out["decoder"] = {"type": "WordPiece", "prefix": tok.prefix, "cleanup": True}
    out["model"] = {
        "type": "WordPiece",
        "unk_token": tok.unk_token,
        "continuing_subword_prefix": tok.prefix,
        "max_input_chars_per_word": tok.max_input_chars_per_word,
        "vocab": dict(sorted(tok.vocab.items(), key=lambda kv: kv[1])),
    }
    return out


def _wordpiece_from_hf(data: dict[str, Any], path: Path, **options: Any) -> Any:
    norm = data.get("normalizer")
    kwargs: dict[str, Any] = {}
    if norm is None:
        kwargs.update(
            lowercase=False, strip_accents=False, clean_text=False, handle_chinese_chars=False
        )
    elif norm.get("type") == "BertNormalizer":
        kwargs.update(
            lowercase=norm.get("lowercase", True),
            strip_accents=norm.get("strip_accents"),
            clean_text=norm.get("clean_text", True),
            handle_chinese_chars=norm.get("handle_chinese_chars", True),
        )
    else:
        raise TokenizerFileError(
            path, f"normalizer {norm.get('type')!r} is not supported for WordPiece (BertNormalizer)"
        )
    pre = data.get("pre_tokenizer")
    if pre is None or pre.get("type") != "BertPreTokenizer":
        raise TokenizerFileError(
            path,
            f"pre-tokenizer {None if pre is None else pre.get('type')!r} is not supported for "
            "WordPiece (BertPreTokenizer)",
        )
    model = data["model"]
    kwargs.update(
        unk_token=model.get("unk_token", "[UNK]"),
        continuing_subword_prefix=model.get("continuing_subword_prefix", "##"),
        max_input_chars_per_word=int(model.get("max_input_chars_per_word", 100)),
        special_tokens=[t["content"] for t in data.get("added_tokens", [])],
    )
    kwargs.update(options)
    try:
        return WordPieceTokenizer({t: int(i) for t, i in model["vocab"].items()}, **kwargs)
    except ValueError as exc:
        raise TokenizerFileError(path, str(exc)) from exc


# --------------------------------------------------------------------------- Unigram
def _unigram_to_hf(tok: Any) -> dict[str, Any]:
    out = _skeleton()
    out["added_tokens"] = [
        _added(tok.pieces[i][0], i) for i in sorted(tok.control_ids | {tok.unk_id})
    ]
    steps: list[dict[str, Any]] = []
    if tok.normalization == "nfkc":
        steps.append({"type": "NFKC"})
    if tok.remove_extra_whitespaces:
        steps.append({"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "})
        steps.append({"type": "Strip", "strip_left": True, "strip_right": True})
    out["normalizer"] = {"type": "Sequence", "normalizers": steps} if steps else None
    scheme = "always" if tok.add_dummy_prefix else "never"
    meta = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": True}
    out["pre_tokenizer"] = meta
    out["decoder"] = {**meta, "split": True}
    out["model"] = {
        "type": "Unigram",
        "unk_id": tok.unk_id,
        "vocab": [[p, s] for p, s in tok.pieces],
        "byte_fallback": False,
    }
    return out


def _unigram_from_hf(data: dict[str, Any], path: Path, **options: Any) -> Any:
    norm = data.get("normalizer")
    steps = [] if norm is None else norm["normalizers"] if norm["type"] == "Sequence" else [norm]
    normalization, remove_extra = "identity", False
    for step in steps:
        kind = step.get("type")
        if kind == "NFKC":
            normalization = "nfkc"
        elif kind in ("Replace", "Strip"):
            remove_extra = True
        else:
            raise TokenizerFileError(
                path, f"normalizer {kind!r} is not supported for Unigram (NFKC, Replace, Strip)"
            )
    pre = data.get("pre_tokenizer")
    if pre is None or pre.get("type") != "Metaspace":
        raise TokenizerFileError(
            path,
            f"pre-tokenizer {None if pre is None else pre.get('type')!r} is not supported for "
            "Unigram (Metaspace)",
        )
    if pre.get("replacement", "▁") != "▁":
        raise TokenizerFileError(path, f"Metaspace replacement {pre['replacement']!r} is not '▁'")
    scheme = pre.get("prepend_scheme", "always" if pre.get("add_prefix_space", True) else "never")
    model = data["model"]
    if model.get("byte_fallback"):
        raise TokenizerFileError(path, "Unigram byte_fallback is not supported")
    unk_id = model.get("unk_id")
    if unk_id is None:
        raise TokenizerFileError(path, "Unigram model without unk_id is not supported")
    controls = [t["id"] for t in data.get("added_tokens", []) if t["id"] != unk_id]
    kwargs: dict[str, Any] = dict(
        unk_id=int(unk_id),
        control_ids=controls,
        add_dummy_prefix=scheme != "never",
        remove_extra_whitespaces=remove_extra,
        normalization=normalization,
    )
    kwargs.update(options)
    return UnigramTokenizer([(p, float(s)) for p, s in model["vocab"]], **kwargs)
