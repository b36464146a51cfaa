"""SentencePiece BPE as HF ``tokenizer.json``: read (Llama 2 / Mistral / Gemma files and every
conversion of a ``.model``) and write.

Writing a model that follows sentencepiece's rules uses the pipeline HF's own converter
(``transformers``' ``SpmConverter``) builds from a ``.model``, so that HF encodes like
sentencepiece: the charsmap as ``Precompiled``, whitespace removal and escaping as ``Replace``
steps, the dummy prefix through ``Metaspace`` (doubled when the text already starts with ``▁``,
which ``Metaspace`` would otherwise skip), user-defined pieces as added tokens, and the merge list
ranked by piece score. One rule cannot be carried over: sentencepiece gives every split of a
piece the same rank (leftmost wins), an HF merge list ranks each pair on its own.
"""

from __future__ import annotations

import base64
from typing import Any

import regex

from llmlab.tokenizer import hf_components
from llmlab.tokenizer.hf_schema import added_token, model_field, skeleton

SPACE = "▁"
_BYTE = regex.compile(r"<0x[0-9A-F]{2}>")


def from_hf_fields(data: dict[str, Any]) -> dict[str, Any]:
    """``SentencePieceBPETokenizer`` keyword arguments from an HF ``tokenizer.json``."""
    model = data["model"]
    model_field(model, "dropout", (None, 0.0))
    vocab: dict[str, int] = model["vocab"]
    entries = data.get("added_tokens") or []
    for entry in entries:
        for flag in ("lstrip", "rstrip", "single_word"):
            if entry.get(flag):
                raise ValueError(f"added token {entry['content']!r} has {flag}=true (unsupported)")
    special = {e["content"]: int(e["id"]) for e in entries if e.get("special")}
    user = {e["content"]: int(e["id"]) for e in entries if not e.get("special")}
    by_id = {i: t for t, i in vocab.items()}
    by_id.update({i: t for t, i in {**special, **user}.items()})
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError("vocabulary ids are not 0..n-1 without gaps")
    unk = model.get("unk_token")
    byte_fallback = bool(model.get("byte_fallback", False))
    pieces = []
    for i in range(len(by_id)):
        token = by_id[i]
        if token == unk:
            kind = "unknown"
        elif token in special:
            kind = "control"
        elif token in user:
            kind = "user_defined"
        elif byte_fallback and _BYTE.fullmatch(token):
            kind = "byte"
        else:
            kind = "normal"
        pieces.append((token, 0.0, kind))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return {
        "pieces": pieces,
        "byte_fallback": byte_fallback,
        "normalizer": hf_components.Pipeline(data.get("normalizer"), data.get("pre_tokenizer")),
        "merges": merges,
        "fuse_unk": bool(model.get("fuse_unk", False)),
        "ignore_merges": bool(model.get("ignore_merges", False)),
        "decoder": data.get("decoder"),
        "special_tokens": list(special),
    }


def to_hf(tok: Any) -> dict[str, Any]:
    out = skeleton()
    if tok.hf_mode:
        user = {p: tok.vocab[p] for p in tok.user_defined}
        out["normalizer"] = tok.front.normalizer_spec
        out["pre_tokenizer"] = tok.front.pre_tokenizer_spec
        out["decoder"] = tok.decoder_spec
        merges = tok.merges
    else:
        user = {p: tok.vocab[p] for p in tok.user_defined}
        out["normalizer"], out["pre_tokenizer"], out["decoder"] = _sp_pipeline(tok)
        merges = score_merges(tok.pieces)
    added = [added_token(p, i) for p, i in tok.special_tokens.items()]
    added += [added_token(p, i, special=False) for p, i in user.items()]
    out["added_tokens"] = sorted(added, key=lambda e: e["id"])
    model = tok.bpe.to_hf(merges)
    model["vocab"] = {p: i for i, (p, _, _) in enumerate(tok.pieces) if tok.vocab[p] == i}
    model["ignore_merges"] = tok.ignore_merges if tok.hf_mode else bool(tok.user_defined)
    out["model"] = model
    return out


def score_merges(pieces: list[tuple[str, float, str]]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, best-scoring piece first (then by
    id and by the halves), as HF's converter ranks them."""
    normal = {p: (s, i) for i, (p, s, k) in enumerate(pieces) if k == "normal"}
    ranked = []
    for piece, (score, i) in normal.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                ranked.append((-score, i, left, right))
    return [(left, right) for _, _, left, right in sorted(ranked)]


def _sp_pipeline(tok: Any) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """(normalizer, pre_tokenizer, decoder) that make HF follow a sentencepiece normalizer."""
    front = tok.front
    steps: list[dict[str, Any]] = []
    if front.charsmap is not None:
        blob = base64.b64encode(front.charsmap.blob).decode("ascii")
        steps.append({"type": "Precompiled", "precompiled_charsmap": blob})
    if front.remove_extra_whitespaces:
        steps.append(_replace({"Regex": r"\A +| +\z"}, ""))
        steps.append(_replace({"Regex": " {2,}"}, " "))
    if front.escape_whitespaces:
        steps.append(_replace({"String": " "}, SPACE))
    if front.add_dummy_prefix:
        steps.append(_replace({"Regex": r"\A▁"}, SPACE + SPACE))
    pre: list[dict[str, Any]] = []
    if front.add_dummy_prefix:
        pre.append(
            {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "always", "split": False}
        )
    if tok.user_defined:
        pattern = "|".join(regex.escape(p) for p in sorted(tok.user_defined, key=len)[::-1])
        pre.append(
            {
                "type": "Split",
                "pattern": {"Regex": pattern},
                "behavior": "Isolated",
                "invert": False,
            }
        )
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}
    ]
    if tok.byte_fallback:
        decoders.append({"type": "ByteFallback"})
    if front.add_dummy_prefix:
        decoders += [{"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]
    elif tok.byte_fallback:
        decoders.append({"type": "Fuse"})
    return (
        {"type": "Sequence", "normalizers": steps},
        {"type": "Sequence", "pretokenizers": pre} if pre else None,
        {"type": "Sequence", "decoders": decoders},
    )


def _replace(pattern: dict[str, str], content: str) -> dict[str, Any]:
    return {"type": "Replace", "pattern": pattern, "content": content}
