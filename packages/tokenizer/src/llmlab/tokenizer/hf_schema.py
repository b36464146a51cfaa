"""The shared parts of HF ``tokenizer.json`` that every model writes and reads.

Each tokenizer class writes its own ``tokenizer.json`` (``to_hf``) and reads it (``from_hf``);
this module holds only what they share, and imports no model, so the models can use it.
"""

from __future__ import annotations

from typing import Any


def skeleton() -> dict[str, Any]:
    """An empty ``tokenizer.json`` with every top-level key HF writes."""
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


def added_token(content: str, token_id: int, special: bool = True) -> dict[str, Any]:
    """One ``added_tokens`` entry: matched verbatim, before normalization."""
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def added_tokens(specials: dict[str, int]) -> list[dict[str, Any]]:
    """``added_tokens`` for special tokens, in id order."""
    return [added_token(s, i) for s, i in sorted(specials.items(), key=lambda kv: kv[1])]


def read_added(data: dict[str, Any], special_only: bool = False) -> dict[str, int]:
    """``added_tokens`` of a file as ``{content: id}`` (only ``special`` ones if asked).

    llmlab matches added tokens verbatim, as HF does for ``normalized=false``; a token HF would
    match loosely (``lstrip``, ``rstrip``, ``single_word``) or after normalization is refused
    rather than matched differently.
    """
    out = {}
    for entry in data.get("added_tokens") or []:
        if special_only and not entry.get("special", False):
            continue
        for flag in ("lstrip", "rstrip", "single_word"):
            if entry.get(flag):
                raise ValueError(f"added token {entry['content']!r} has {flag}=true (unsupported)")
        if entry.get("normalized") and data.get("normalizer") is not None:
            raise ValueError(
                f"added token {entry['content']!r} is matched after normalization "
                "(normalized=true with a normalizer), which llmlab does not support"
            )
        out[entry["content"]] = int(entry["id"])
    return out


def model_field(model: dict[str, Any], key: str, supported: tuple[Any, ...]) -> Any:
    """``model[key]``, refused with a message naming it unless it is one of ``supported``."""
    value = model.get(key)
    if value not in supported:
        raise ValueError(f"model field {key}={value!r} is not supported (supported: {supported})")
    return value


def require(spec: dict[str, Any] | None, kind: str, what: str, family: str) -> dict[str, Any]:
    """``spec`` if it is a component of type ``kind``, else an error naming what was found."""
    if spec is None or spec.get("type") != kind:
        found = None if spec is None else spec.get("type")
        raise ValueError(f"{what} {found!r} is not supported for {family} ({kind})")
    return spec
