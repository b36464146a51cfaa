"""Byte-level BPE's file formats: HF ``tokenizer.json``, ``.tiktoken`` ranks, GPT-2's
``encoder.json`` + ``vocab.bpe``.

Readers return the keyword arguments of ``BPETokenizer`` (ranks, merges, pattern, special
tokens...) and writers take the tokenizer, so this module never imports the class that uses it.
Every reader refuses, naming the field, what llmlab would encode differently from the file's
own library.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

from llmlab.tokenizer.byte_level import bytes_to_token_string, token_string_to_bytes
from llmlab.tokenizer.errors import TokenizerFileError
from llmlab.tokenizer.hf_schema import added_tokens, read_added, skeleton
from llmlab.tokenizer.patterns import HF_BYTELEVEL_PATTERN, to_onig

NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD")


# --------------------------------------------------------------------------- tokenizer.json
def to_hf(tok: Any) -> dict[str, Any]:
    out = skeleton()
    out["added_tokens"] = added_tokens(tok.special_tokens)
    if tok.normalizer is not None:
        out["normalizer"] = {"type": tok.normalizer}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    out["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": to_onig(tok.pattern)},
                "behavior": "Isolated",
                "invert": False,
            },
            {**byte_level, "use_regex": False},
        ],
    }
    if tok.add_prefix_space:  # HF's ByteLevel would prefix every split piece: prepend once
        out["normalizer"] = _sequence(out["normalizer"], {"type": "Prepend", "prepend": " "})
    out["decoder"] = {**byte_level, "add_prefix_space": True, "use_regex": True}
    vocab = dict(tok.special_tokens)
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


def _sequence(first: dict[str, Any] | None, then: dict[str, Any]) -> dict[str, Any]:
    return then if first is None else {"type": "Sequence", "normalizers": [first, then]}


def _normalizer(spec: dict[str, Any] | None, path: Path) -> tuple[str | None, bool]:
    """(unicode normalization form, add_prefix_space) of the normalizers llmlab supports here."""
    steps = [] if spec is None else spec.get("normalizers", [spec])
    form, prefix = None, False
    for step in steps:
        kind = step.get("type")
        if kind in NORMALIZERS and form is None and not prefix:
            form = kind
        elif kind == "Prepend" and step.get("prepend") == " " and not prefix:
            prefix = True
        else:
            raise TokenizerFileError(
                path,
                f"normalizer {kind!r} is not supported for byte-level BPE (supported: one of "
                f"{', '.join(NORMALIZERS)}, then Prepend(' '))",
            )
    return form, prefix


def _pre_tokenizer(pre: Any, path: Path) -> tuple[str, bool]:
    """(regex, add_prefix_space) from a ByteLevel or Sequence[Split, ByteLevel] pre-tokenizer."""
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
            if steps[1].get("add_prefix_space", False):
                raise TokenizerFileError(
                    path,
                    "ByteLevel(add_prefix_space=true) after a Split prefixes every piece with a "
                    "space; llmlab does not support it",
                )
            return steps[0]["pattern"]["Regex"], False
    raise TokenizerFileError(
        path,
        f"pre-tokenizer {pre.get('type')!r} is not supported for byte-level BPE (supported: "
        "ByteLevel, or Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)])",
    )


def from_hf(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """``BPETokenizer`` keyword arguments from a byte-level BPE ``tokenizer.json``."""
    model = data["model"]
    if model.get("dropout"):
        raise TokenizerFileError(path, "BPE dropout is not supported (encoding would be random)")
    form, prefix_from_normalizer = _normalizer(data.get("normalizer"), path)
    pattern, add_prefix_space = _pre_tokenizer(data.get("pre_tokenizer"), path)
    try:
        specials = read_added(data)
    except ValueError as exc:
        raise TokenizerFileError(path, str(exc)) from exc
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
    by_string = model["vocab"]
    merges = []
    last, made_before = -1, set()
    for m in model.get("merges", []):
        left, right = m.split(" ") if isinstance(m, str) else m
        made = by_string.get(left + right)
        if made is None or (made <= last and made not in made_before):
            # llmlab (like tiktoken) merges by the id of the result: the file's merge order
            # must be its id order, or the two would encode differently.
            raise TokenizerFileError(
                path,
                f"merge {left!r} {right!r} (#{len(merges)}) does not make a token with a larger "
                "id than the merge before it; llmlab needs merges in id order",
            )
        last = max(last, made)
        made_before.add(made)
        merges.append((by_string[left], by_string[right]))
    return {
        "ranks": ranks,
        "merges": merges,
        "pattern": pattern,
        "special_tokens": specials,
        "add_prefix_space": add_prefix_space or prefix_from_normalizer,
        "normalizer": form,
    }


# --------------------------------------------------------------------------- .tiktoken
def save_tiktoken(ranks: dict[bytes, int]) -> bytes:
    lines = [
        f"{base64.b64encode(t).decode('ascii')} {r}\n"
        for t, r in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    return "".join(lines).encode("ascii")


def read_tiktoken(path: Path, raw: bytes) -> dict[bytes, int]:
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
    return ranks


# --------------------------------------------------------------------------- GPT-2 files
def read_gpt2(encoder_json: Path, vocab_bpe: Path) -> dict[str, Any]:
    """GPT-2's ``encoder.json`` (token string -> id) and ``vocab.bpe`` (merges), also the
    ``vocab.json`` + ``merges.txt`` pair of byte-level models (RoBERTa, GPT-2 on the HF hub)."""
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
    merges = []
    for lineno, line in merge_lines(vocab_bpe):
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
            f"{len(merges)} merges but {encoder_json.name} has {len(ranks) - 256} non-byte tokens",
        )
    return {"ranks": ranks, "merges": merges, "pattern": "gpt2", "special_tokens": specials}


def merge_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, "left right") of a ``merges.txt`` / ``vocab.bpe`` (``#version`` skipped)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    return [
        (n, line.rstrip("\r"))
        for n, line in enumerate(lines, start=1)
        if line.strip() and not (n == 1 and line.startswith("#version"))
    ]
