"""Bytes one context-parallel rank sends for ring attention: the formula ``comm/cp_bytes`` meets.

Per attention layer and micro-batch, with ``N`` context ranks, a local chunk of
``c = B · H_kv · (T/N) · D`` elements per key or value tensor (only the key/value heads travel),
``s`` the bytes of the activation dtype and ``s_acc`` those of the accumulation dtype (fp32 for
bf16/fp16/fp32, fp64 for fp64)::

    forward    (N − 1) · 2c · s             the key and value chunks go round the ring once
    backward   (N − 1) · 2c · (s + s_acc)   once more (re-sent, not stored), plus the dK/dV
                                            buffers that follow them home in s_acc

so a training step sends ``layers · (N − 1) · 2c · (forwards·s + s + s_acc)`` bytes per rank,
``forwards`` being 2 when activation checkpointing re-runs the forward. Every rank sends the
same amount whatever the split (zigzag or contiguous): a chunk travels even to a rank that
masks all of it, because the ring passes it on. Measured bytes are counted by
:class:`llmlab.parallel.comm.CommStats` in :class:`~llmlab.parallel.context.ring.RingTransport`.
"""

from __future__ import annotations

import torch

from llmlab.parallel.context.blocks import accumulation_dtype


def cp_bytes(
    batch: int,
    kv_heads: int,
    seq_len: int,
    head_dim: int,
    degree: int,
    dtype: torch.dtype,
    layers: int = 1,
    backward: bool = True,
    forwards: int = 1,
) -> int:
    """Bytes one rank sends for ring attention over a ``seq_len``-token sequence (whole length)
    split over ``degree`` ranks: ``layers`` attention layers, one micro-batch of ``batch``."""
    for name, value in (("batch", batch), ("kv_heads", kv_heads), ("seq_len", seq_len),
                        ("head_dim", head_dim), ("degree", degree), ("layers", layers),
                        ("forwards", forwards)):  # fmt: skip
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"cp_bytes: {name} must be a positive integer, got {value!r}")
    if seq_len % degree:
        raise ValueError(f"cp_bytes: seq_len {seq_len} is not divisible by degree {degree}")
    chunk = batch * kv_heads * (seq_len // degree) * head_dim
    s, s_acc = dtype.itemsize, accumulation_dtype(dtype).itemsize
    per_layer = (degree - 1) * 2 * chunk * (forwards * s + ((s + s_acc) if backward else 0))
    return layers * per_layer
