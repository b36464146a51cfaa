"""Logits processors: small functions ``(input_ids, scores) -> scores`` composed in a fixed order.

Each one rewrites the next-token scores of every row; ``-inf`` removes a token. The order is the
one HF ``generate`` uses, so the resulting distribution is the same (tested to 1e-6):

1. **penalties**, applied to every strategy: repetition penalty, no-repeat-n-gram, then
   min-new-tokens (eos banned until enough tokens exist);
2. **warpers**, only when sampling: temperature, top-k, top-p, min-p.

Temperature comes before the truncations so that top-p and min-p act on the distribution that is
actually sampled (llama.cpp's argument for min-p after temperature, adopted by HF).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from llmlab.decoding.config import GenerationConfig

Processor = Callable[[Tensor, Tensor], Tensor]
NEG_INF = -float("inf")


class RepetitionPenalty:
    """CTRL's penalty: a token already in the context has its score divided by ``penalty`` when
    positive and multiplied when negative, so it always becomes less likely (``penalty > 1``).

    ``ignore_prefix`` (one length per row) skips left padding so pad ids are not penalised.
    """

    def __init__(self, penalty: float, ignore_prefix: Tensor | None = None) -> None:
        self.penalty = float(penalty)
        self.ignore_prefix = ignore_prefix

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        vocab = scores.shape[-1]
        ids = input_ids.clamp(max=vocab)  # ids the head cannot emit go to a spare column
        if self.ignore_prefix is not None:
            pos = torch.arange(ids.shape[1], device=ids.device)
            ids = ids.masked_fill(pos[None, :] < self.ignore_prefix.to(ids.device)[:, None], vocab)
        padded = torch.nn.functional.pad(scores, (0, 1))
        seen = padded.gather(1, ids)
        seen = torch.where(seen < 0, seen * self.penalty, seen / self.penalty)
        return padded.scatter(1, ids, seen)[:, :vocab]


class NoRepeatNGram:
    """Ban every token that would complete an n-gram already present in the row.

    The next token completes an n-gram whose first ``n-1`` tokens are the row's current suffix;
    every earlier window that starts with that suffix bans its own last token.
    """

    def __init__(self, ngram_size: int) -> None:
        self.n = ngram_size

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        length = input_ids.shape[1]
        if length < self.n:
            return scores
        vocab = scores.shape[-1]
        suffix = input_ids[:, length - self.n + 1 :]  # (N, n-1)
        windows = input_ids.unfold(1, self.n, 1)  # (N, W, n)
        hit = (windows[..., :-1] == suffix[:, None, :]).all(-1)  # (N, W)
        banned_ids = torch.where(hit, windows[..., -1].clamp(max=vocab), vocab)
        banned = torch.zeros(scores.shape[0], vocab + 1, dtype=torch.bool, device=scores.device)
        banned.scatter_(1, banned_ids, True)
        return scores.masked_fill(banned[:, :vocab], NEG_INF)


class MinNewTokens:
    """Forbid every eos id until ``min_new_tokens`` tokens follow the prompt."""

    def __init__(self, prompt_len: int, min_new_tokens: int, eos_ids: Sequence[int]) -> None:
        self.prompt_len = prompt_len
        self.min_new_tokens = min_new_tokens
        self.eos_ids = list(eos_ids)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if input_ids.shape[1] - self.prompt_len >= self.min_new_tokens:
            return scores
        out = scores.clone()
        out[:, [e for e in self.eos_ids if e < scores.shape[-1]]] = NEG_INF
        return out


class Temperature:
    """``logits / T``: T < 1 sharpens the distribution, T > 1 flattens it."""

    def __init__(self, temperature: float) -> None:
        self.temperature = float(temperature)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        return scores / self.temperature


class TopK:
    """Keep the ``k`` highest scores (ties with the k-th are kept too)."""

    def __init__(self, k: int, min_tokens_to_keep: int = 1) -> None:
        self.k = max(k, min_tokens_to_keep)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        k = min(self.k, scores.shape[-1])
        kth = scores.topk(k, dim=-1).values[..., -1:]
        return scores.masked_fill(scores < kth, NEG_INF)


class TopP:
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches ``p``.

    Sorted ascending, a token is dropped when the cumulative mass up to and including it is at
    most ``1 - p`` (so everything above it still holds at least ``p``).
    """

    def __init__(self, p: float, min_tokens_to_keep: int = 1) -> None:
        self.p = float(p)
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        sorted_scores, order = scores.sort(dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - self.p)
        drop_sorted[..., -self.min_tokens_to_keep :] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        return scores.masked_fill(drop, NEG_INF)


class MinP:
    """Keep tokens whose probability is at least ``min_p`` times the most likely token's."""

    def __init__(self, min_p: float, min_tokens_to_keep: int = 1) -> None:
        self.min_p = float(min_p)
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        probs = scores.softmax(dim=-1)
        drop = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
        keep = probs.topk(min(self.min_tokens_to_keep, probs.shape[-1]), dim=-1).indices
        drop.scatter_(-1, keep, False)
        return scores.masked_fill(drop, NEG_INF)


class ProcessorList(list):
    """Apply processors left to right."""

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


def padding_lengths(attention_mask: Tensor | None) -> Tensor | None:
    """Left-padding length per row (index of the first real token), or None without a mask."""
    if attention_mask is None:
        return None
    return (attention_mask != 0).int().argmax(dim=1)


def build_processors(
    config: GenerationConfig,
    prompt_len: int,
    attention_mask: Tensor | None = None,
    sampling: bool | None = None,
) -> ProcessorList:
    """The processors ``config`` asks for, in the documented order (see the module docstring).

    ``sampling`` defaults to ``config.do_sample``; warpers are only added when sampling. In beam
    sampling the truncations keep at least ``len(eos) + 1`` tokens so a beam can always continue.
    """
    sampling = config.do_sample if sampling is None else sampling
    out = ProcessorList()
    if config.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(config.repetition_penalty, padding_lengths(attention_mask)))
    if config.no_repeat_ngram_size > 0:
        out.append(NoRepeatNGram(config.no_repeat_ngram_size))
    if config.min_new_tokens > 0 and config.eos_token_ids:
        out.append(MinNewTokens(prompt_len, config.min_new_tokens, config.eos_token_ids))
    if sampling:
        keep = (
            (len(config.eos_token_ids) + 1 if config.eos_token_ids else 2)
            if (config.num_beams > 1)
            else 1
        )
        if config.temperature != 1.0:
            out.append(Temperature(config.temperature))
        if config.top_k:
            out.append(TopK(config.top_k, keep))
        if config.top_p < 1.0:
            out.append(TopP(config.top_p, keep))
        if config.min_p is not None:
            out.append(MinP(config.min_p, keep))
    return out
