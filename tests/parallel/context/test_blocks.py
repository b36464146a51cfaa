"""The merge identity and the per-block backward that ring attention is built on (one process),
and ``cp_bytes``' formula on a hand-computed case.

Oracle: ``torch.nn.functional.scaled_dot_product_attention`` on all keys at once (its autograd
for the gradients). Tolerances: fp64 1e-12, fp32 1e-5, bf16 2e-2 (against the fp64 oracle).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlab.parallel.context import block_backward, block_forward, cp_bytes, merge_into
from llmlab.parallel.context.blocks import accumulation_dtype, resolve_backend

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _qkv(dtype, heads=4, kv_heads=2, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, T, 8), (2, kv_heads, T, 8), (2, kv_heads, T, 8), (2, heads, T, 8)]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


@pytest.mark.parametrize("backend", ["flash", "blocked"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_merging_key_chunks_by_lse_equals_attention_over_all_keys(dtype, backend):
    q, k, v, do = _qkv(dtype)
    chunks = [(0, 5), (5, 6), (6, 12)]  # uneven, and merged out of order
    acc = accumulation_dtype(dtype)
    out = torch.zeros(q.shape, dtype=acc)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc)
    for a, b in reversed(chunks):
        merge_into(out, lse, *block_forward(q, k[:, :, a:b], v[:, :, a:b], False, backend))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, enable_gqa=True)
    ref.backward(do.double())
    torch.testing.assert_close(out.double(), ref.detach(), rtol=0, atol=TOL[dtype])
    scores = (q.double() @ k.double().repeat_interleave(2, 1).mT) / 8**0.5  # GQA: 2 per group
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), rtol=0, atol=TOL[dtype])

    # backward per chunk with the *final* out and lse: dq shares sum, dk/dv chunks are complete
    final = out.to(dtype)
    dq = torch.zeros(q.shape, dtype=acc)
    dks, dvs = [], []
    for a, b in chunks:
        dq_c, dk_c, dv_c = block_backward(do, q, k[:, :, a:b], v[:, :, a:b], final, lse, False,
                                          backend)  # fmt: skip
        dq += dq_c
        dks.append(dk_c)
        dvs.append(dv_c)
    for ours, leaf in zip((dq, torch.cat(dks, 2), torch.cat(dvs, 2)), leaves):
        torch.testing.assert_close(ours.double(), leaf.grad, rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize("backend", ["flash", "blocked"])
def test_a_causal_diagonal_block_is_sdpa_is_causal(backend):
    q, k, v, do = _qkv(torch.float64, heads=2, kv_heads=2)
    out, lse = block_forward(q, k, v, True, backend)
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=0, atol=1e-12
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, is_causal=True).backward(do)
    grads = block_backward(do, q, k, v, out, lse, True, backend)
    for ours, leaf in zip(grads, leaves):
        torch.testing.assert_close(ours, leaf.grad, rtol=0, atol=1e-12)


def test_backend_choice_is_checked_against_the_device():
    assert resolve_backend("auto", torch.device("cpu")) == "flash"
    assert resolve_backend("auto", torch.device("cuda")) == "blocked"
    with pytest.raises(ValueError, match="'flash' is PyTorch's CPU kernel; tensors are on cuda"):
        resolve_backend("flash", torch.device("cuda"))
    with pytest.raises(ValueError, match="unknown ring-attention backend 'fast'"):
        resolve_backend("fast", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_blocked_backend_merges_exactly_on_cuda():
    q, k, v, _ = (t.cuda() for t in _qkv(torch.float64))
    out = torch.zeros(q.shape, dtype=torch.float64, device="cuda")
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64, device="cuda")
    for a, b in ((0, 6), (6, 12)):
        merge_into(out, lse, *block_forward(q, k[:, :, a:b], v[:, :, a:b], False, "blocked"))
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_cp_bytes_by_hand():
    # B=2, H_kv=2, T=32 over N=4 (8 tokens each), D=16: a chunk is 512 elements per k or v.
    # fp32: forward 3 · 2 · 512 · 4 = 12288; backward 3 · 2 · 512 · (4 + 4) = 24576.
    assert cp_bytes(2, 2, 32, 16, 4, torch.float32, backward=False) == 12288
    assert cp_bytes(2, 2, 32, 16, 4, torch.float32) == 12288 + 24576
    # bf16: kv in 2 bytes, the dK/dV buffers in fp32: 3 · 2 · 512 · (2 + 2 + 4)
    assert cp_bytes(2, 2, 32, 16, 4, torch.bfloat16) == 24576
    # layers multiply; activation checkpointing re-sends the forward's chunks
    assert cp_bytes(2, 2, 32, 16, 4, torch.float32, layers=3, forwards=2) == 3 * (2 * 12288 + 24576)
    assert cp_bytes(2, 2, 32, 16, 1, torch.float64) == 0  # one rank sends nothing
    with pytest.raises(ValueError, match="seq_len 30 is not divisible by degree 4"):
        cp_bytes(2, 2, 30, 16, 4, torch.float32)
