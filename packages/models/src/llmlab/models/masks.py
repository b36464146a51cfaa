"""Positions and attention masks for decoding, shared by every llmlab decoder (GPT, Llama).

Both follow HF: a left-padded row's first real token gets position 0, so padded and unpadded
rows see the same positions (learned position table or RoPE angles alike), and padded keys are
hidden from every query.
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
