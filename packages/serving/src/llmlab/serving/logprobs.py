"""Log-probabilities from the logits a step already computed: no second forward.

A generated token's log-probability is ``log_softmax(logits)[token]`` of the row its step
chose it from; a prompt token's (``echo``, lm-eval's log-likelihoods) is the same of the row at
the position before it, which prefill keeps only for requests that ask
(``RequestOptions.prompt_logprobs``). The logits are the model's own, before any logits
processor, temperature, top-k/p or mask -- what OpenAI and vLLM report by default, and what
``log_softmax`` of HF's logits gives, so a client's log-likelihood does not depend on how it
samples.
"""

from __future__ import annotations

import codecs
import math
from typing import Any

import torch
from torch import Tensor

from llmlab.serving.sequence import TokenLogprob


def token_logprobs(logits: Tensor, chosen: list[int], top: list[int]) -> list[TokenLogprob]:
    """For each row ``r`` of ``logits`` (R, V): ``chosen[r]``'s log-probability and the
    ``top[r]`` most likely ids with theirs, best first (ties: the smaller id first)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(chosen, dtype=torch.long, device=logp.device)
    picked = logp.gather(1, index[:, None])[:, 0].tolist()
    k = min(max(top, default=0), logp.shape[-1])
    tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
    if k:
        values, ids = logp.topk(k, dim=-1)
        # best first, equal log-probabilities in id order
        tops = [sorted(zip(i, v), key=lambda iv: (-iv[1], iv[0]))
                for i, v in zip(ids.tolist(), values.tolist())]  # fmt: skip
    return [TokenLogprob(c, p, t[:n]) for c, p, t, n in zip(chosen, picked, tops, top)]


# ---------------------------------------------------------------- OpenAI's shapes
FLOOR = -9999.0  # what OpenAI reports for a log-probability of -inf (JSON has no infinity)


def _number(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


class TokenText:
    """A token's text and bytes as OpenAI reports them: its UTF-8 text when its bytes are whole
    characters, else ``"bytes:\\xe2\\x80"`` (half a character, as OpenAI spells it); with no
    tokenizer, or for an id it cannot decode, ``"token_id:<id>"`` and no bytes (vLLM's form).
    Cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes | None]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes | None]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._render(token_id)
        return hit

    def _render(self, token_id: int) -> tuple[str, bytes | None]:
        tok = self.tokenizer
        if tok is None:
            return f"token_id:{token_id}", None
        try:
            decode_bytes = getattr(tok, "decode_bytes", None)
            data = decode_bytes([token_id]) if decode_bytes else tok.decode([token_id]).encode()
        except Exception:
            return f"token_id:{token_id}", None
        try:
            return data.decode("utf-8"), data
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data


class TextOffsets:
    """The character offset of each token in the text its tokens decode to, token by token
    (a token that ends inside a character: the next one starts at that character)."""

    def __init__(self) -> None:
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, data: bytes | None) -> int:
        at = self.chars
        if data:
            self.chars += len(self._decoder.decode(data))
        return at


def completion_logprobs(
    entries: list[tuple[int, TokenLogprob | None]], text: TokenText, offsets: TextOffsets
) -> dict[str, list]:
    """The legacy completions ``logprobs`` object of ``(token id, its log-probability or None)``
    entries: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict of the most likely
    tokens' texts, the chosen token's always among them, as OpenAI's) and ``text_offset``."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}  # fmt: skip
    for token_id, logprob in entries:
        piece, data = text(token_id)
        out["tokens"].append(piece)
        out["text_offset"].append(offsets.next(data))
        if logprob is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_number(logprob.logprob))
        top: dict[str, float] = {}
        for alt, value in logprob.top:  # best first: a text two ids share keeps the better one
            top.setdefault(text(alt)[0], _number(value))
        top.setdefault(piece, _number(logprob.logprob))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(logprobs: list[TokenLogprob], text: TokenText) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``: per token its text, log-probability, bytes and its
    ``top_logprobs`` (a list, best first)."""

    def entry(token_id: int, value: float) -> dict[str, Any]:
        piece, data = text(token_id)
        return {"token": piece, "logprob": _number(value),
                "bytes": None if data is None else list(data)}  # fmt: skip

    return [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
        for lp in logprobs
    ]
