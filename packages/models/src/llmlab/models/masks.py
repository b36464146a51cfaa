"""Positions and attention masks, shared by every llmlab decoder (GPT, Llama).

Decoding follows HF: a left-padded row's first real token gets position 0, so padded and
unpadded rows see the same positions (learned position table or RoPE angles alike), and padded
keys are hidden from every query.

Training on packed rows (several documents one after another) with ``document_ids`` does the
same per document: positions restart at 0 at every document's first token, and attention is
block-diagonal (the attention ops take the ids themselves), so a token's logits are those of its
document run alone.
"""

from __future__ import annotations

import torch
from torch import Tensor


def default_positions(input_ids: Tensor, past: int, attention_mask: Tensor | None) -> Tensor:
    """(1, T) positions ``past .. past + T - 1``, or (B, T) ones that follow the padding mask."""
    T = input_ids.shape[1]
    if attention_mask is None:
        return torch.arange(past, past + T, device=input_ids.device).unsqueeze(0)
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp_(min=0)[:, past : past + T]


def attention_bias(
    input_ids: Tensor, past: int, attention_mask: Tensor | None, window: int | None = None
) -> Tensor:
    """Boolean (B, 1, T, past + T) mask: causal, padded keys hidden, never an empty row; with a
    ``window`` a query at position ``i`` sees only keys ``(i - window, i]`` (as HF's sliding
    window mask)."""
    T = input_ids.shape[1]
    S = past + T
    device = input_ids.device
    query_pos = torch.arange(past, S, device=device).unsqueeze(1)
    key_pos = torch.arange(S, device=device).unsqueeze(0)
    allowed = key_pos <= query_pos
    if window is not None:
        allowed = allowed & (key_pos > query_pos - window)
    allowed = allowed.unsqueeze(0)  # (1, T, S)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, :S].bool()
    # A padding query sees no key at all; let it see itself so softmax has no empty row (its
    # output is never used, and no real token attends to it).
    allowed = allowed | (key_pos == query_pos).unsqueeze(0)
    return allowed.unsqueeze(1)


def document_positions(document_ids: Tensor) -> Tensor:
    """(B, T) position of each token inside its document: 0 at each document's first token.

    ``document_ids``: (B, T) integer ids, non-decreasing along each row (a packed row's
    documents in order); refused otherwise, since attention assumes contiguous documents.
    """
    if document_ids.dim() != 2 or document_ids.dtype.is_floating_point:
        raise ValueError(
            "document_ids must be (B, T) integer ids, got "
            f"{document_ids.dtype} of shape {tuple(document_ids.shape)}"
        )
    step = document_ids[:, 1:] - document_ids[:, :-1]
    if bool((step < 0).any()):
        raise ValueError(
            "document_ids must be non-decreasing along each row (documents are contiguous "
            "runs of a packed row)"
        )
    B, T = document_ids.shape
    idx = torch.arange(T, device=document_ids.device).expand(B, T)
    first = torch.ones(B, T, dtype=torch.bool, device=document_ids.device)
    first[:, 1:] = step != 0
    return idx - torch.where(first, idx, 0).cummax(dim=1).values


def resolve_positions(
    input_ids: Tensor,
    positions: Tensor | None,
    past: int,
    attention_mask: Tensor | None,
    document_ids: Tensor | None,
    cached: bool,
) -> Tensor:
    """The positions a forward uses: the given ones, else per document (packed training rows),
    else :func:`default_positions`. ``document_ids`` are refused with a KV cache or a padding
    mask (decoding) and with a shape other than the ids'."""
    if document_ids is None:
        return (
            default_positions(input_ids, past, attention_mask) if positions is None else positions
        )
    if cached or attention_mask is not None:
        raise ValueError(
            "document_ids are for training on packed rows; they cannot be combined with a KV "
            "cache or an attention_mask (decoding)"
        )
    if document_ids.shape != input_ids.shape:
        raise ValueError(
            f"document_ids has shape {tuple(document_ids.shape)}, input_ids "
            f"{tuple(input_ids.shape)}: one id per token"
        )
    return document_positions(document_ids) if positions is None else positions
