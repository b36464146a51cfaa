"""Flash attention under the interpreter vs ``F.scaled_dot_product_attention`` in float64.

Tolerances: fp32 atol/rtol 2e-5 for outputs and gradients (O(1) values, fp32 online softmax);
fp16 atol/rtol 5e-3 and bf16 3e-2: P is rounded to the input dtype before the P.V product (as
on the GPU's tensor cores), on top of rounding the result, so ~3 ulps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlab.kernels import attention

TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}

# (B, H, L, S, D): lengths not multiples of the 16-wide interpreter tiles, head dims not powers
# of two, and L != S (cross-attention shapes; causal is top-left aligned as in SDPA).
CASES = [(1, 2, 37, 37, 24), (2, 3, 5, 5, 8), (1, 1, 20, 45, 16), (2, 1, 33, 17, 40)]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_attention_matches_sdpa(case, causal, dtype):
    B, H, L, S, D = case
    q = torch.randn(B, H, L, D).to(dtype).requires_grad_()
    k = torch.randn(B, H, S, D).to(dtype).requires_grad_()
    v = torch.randn(B, H, S, D).to(dtype).requires_grad_()
    out = attention(q, k, v, causal=causal)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    torch.testing.assert_close(out, ref.to(dtype), **TOL[dtype])
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    for name, g, g64 in zip("qkv", got, want):
        torch.testing.assert_close(
            g, g64.to(dtype), **TOL[dtype], msg=lambda m, n=name: f"d{n}: {m}"
        )


def test_attention_custom_scale_and_gpt_layout():
    """Non-contiguous q/k/v (the GPT slices them out of one qkv projection) and a given scale."""
    B, T, H, D = 2, 19, 2, 16
    qkv = torch.randn(B, T, H, 3, D, requires_grad=True)
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    out = attention(q, k, v, causal=True, scale=0.3)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    (g,) = torch.autograd.grad(out.square().sum(), qkv)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), qkv)
    torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-4)


def test_attention_saves_log_sum_exp():
    """The forward's saved lse is log(sum_j exp(s_ij)) of the masked, scaled scores."""
    from llmlab.kernels.attention import triton_forward

    q, k, v = torch.randn(1, 21, 8), torch.randn(1, 21, 8), torch.randn(1, 21, 8)
    _, lse = triton_forward(q, k, v, causal=True, scale=0.5)
    s = (q @ k.transpose(1, 2)) * 0.5
    s = s.masked_fill(~torch.ones(21, 21, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_gradcheck_float64(causal):
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    fn = lambda q, k, v: attention(q, k, v, causal=causal)  # noqa: E731
    # The kernels hold scale and log2(e) as fp32 constants: ~1e-7 relative, inside gradcheck's
    # default atol 1e-5 / rtol 1e-3.
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("seed", range(3))
def test_random_shapes_fp32(seed):
    g = torch.Generator().manual_seed(seed)
    L, S = (int(v) for v in torch.randint(1, 50, (2,), generator=g))
    D = int(torch.randint(1, 65, (1,), generator=g))
    causal = bool(seed % 2)
    q = torch.randn(1, 2, L, D, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, S, D, generator=g, requires_grad=True) for _ in range(2))
    out = attention(q, k, v, causal=causal)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)
    do = torch.randn(out.shape, generator=g)
    for a, r in zip(
        torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)
    ):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4)


# (B, H, H_kv, T, D, documents of row 0, of row 1): lengths off the 16-wide tiles, one-token
# documents, a document spanning tiles, grouped-query heads.
DOC_CASES = [
    (2, 4, 2, 37, 16, [3, 17, 17], [20, 17]),
    (1, 2, 2, 33, 8, [1, 1, 15, 16], None),
    (2, 2, 1, 20, 24, [20], [7, 1, 12]),
]


def _doc_ids(B: int, T: int, lengths: list, other: list | None) -> torch.Tensor:
    rows = [lengths, other or [T]][:B]
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) * 3 for r in rows]
    )  # non-consecutive ids: only equality and order matter


@pytest.mark.parametrize("case", DOC_CASES)
def test_document_masked_attention_matches_the_masked_reference(case):
    """Block-diagonal causal attention (packed documents): the kernel, with its skipped tiles,
    against SDPA with the explicit mask in float64 (outputs and q/k/v gradients, fp32 atol 2e-5)."""
    B, H, H_kv, T, D, lengths, other = case
    docs = _doc_ids(B, T, lengths, other)
    q = torch.randn(B, H, T, D, requires_grad=True)
    k, v = (torch.randn(B, H_kv, T, D, requires_grad=True) for _ in range(2))
    out = attention(q, k, v, causal=True, document_ids=docs)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    same = docs[:, None, :, None] == docs[:, None, None, :]
    mask = same & torch.ones(T, T, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, enable_gqa=H_kv != H)
    torch.testing.assert_close(out, ref.float(), **TOL[torch.float32])
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    for name, g, g64 in zip("qkv", got, want):
        torch.testing.assert_close(
            g, g64.float(), **TOL[torch.float32], msg=lambda m, n=name: f"d{n}: {m}"
        )


@pytest.mark.slow  # ~20 interpreted forwards of every op: a minute on 2 cores
def test_document_masked_models_on_the_kernels_equal_each_document_alone():
    """Done-when 3 through the Triton kernels: GPT and Llama with ``kernels="triton"``."""
    from llmlab.models import build_model
    from tests.models.document_mask_common import MODELS, check

    for cfg in MODELS.values():
        torch.manual_seed(0)
        model = build_model({**cfg, "kernels": "triton", "n_layer": 1}).eval()

        def logits_of(ids, docs, model=model):
            return model(ids) if docs is None else model(ids, document_ids=docs)

        check(logits_of)
