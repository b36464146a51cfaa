"""The compiled Triton kernels on a CUDA GPU vs torch (skipped here: this machine has no GPU).

Same oracles as the interpreter tests, at GPU-sized shapes, through the autotuned paths.
Tolerances: fp32 uses TF32 tensor cores when torch allows it, so 1e-2 relative for matmul and
attention in fp32; fp16 2e-3 / bf16 1.6e-2 (x2 for gradients) elsewhere, as in interpreter/.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import llmlab.kernels as K

pytestmark = pytest.mark.gpu
TOL = {
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
GRAD_TOL = {d: {k: 2 * v for k, v in t.items()} for d, t in TOL.items()}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(512, 512, 512), (1000, 777, 333)])
def test_matmul_autotuned(shape, dtype):
    M, N, K_ = shape
    a = torch.randn(M, K_, device="cuda", dtype=dtype)
    b = torch.randn(K_, N, device="cuda", dtype=dtype)
    bias = torch.randn(N, device="cuda", dtype=dtype)
    want = F.gelu(a.double() @ b.double() + bias.double(), approximate="tanh").to(dtype)
    # Sums of K products of O(1) values: scale the tolerance with sqrt(K).
    tol = {k: v * (K_ / 64) ** 0.5 for k, v in TOL[dtype].items()}
    torch.testing.assert_close(K.matmul(a, b, bias, "gelu"), want, **tol)


def _causal_softmax(x):
    mask = torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).tril()
    return torch.softmax(x.masked_fill(~mask, -torch.inf), -1)


FUSIONS = {
    "bias_gelu": (K.bias_gelu, lambda x, b: F.gelu(x + b, approximate="tanh"), 2),
    "layer_norm": (K.layer_norm, lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b), 3),
    "add_layer_norm": (
        lambda x, r, w, b: K.add_layer_norm(x, r, w, b)[0],
        lambda x, r, w, b: F.layer_norm(x + r, (x.shape[-1],), w, b),
        4,
    ),
    "softmax": (lambda x: K.softmax(x, causal=True), _causal_softmax, 1),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", list(FUSIONS))
def test_fusions_forward_backward(op, dtype):
    fused, eager, n_inputs = FUSIONS[op]
    shapes = [(64, 1000)] + [(1000,)] * (n_inputs - 1)
    if op == "add_layer_norm":
        shapes[1] = (64, 1000)
    inputs = [torch.randn(s, device="cuda", dtype=dtype, requires_grad=True) for s in shapes]
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    y, y64 = fused(*inputs), eager(*inputs64)  # oracle: torch in float64
    torch.testing.assert_close(y, y64.to(dtype), **TOL[dtype])
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, inputs, dy)
    want = torch.autograd.grad(y64, inputs64, dy.double())
    for g, g64 in zip(got, want):
        tol = {k: v * 8 for k, v in GRAD_TOL[dtype].items()}  # weight grads sum 64 rows
        torch.testing.assert_close(g, g64.to(dtype), **tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads, head_dim", [(4, 64), (2, 128)])
def test_attention_vs_sdpa(causal, dtype, kv_heads, head_dim):
    """300 tokens: every autotuned tile size leaves a partial tile, so both the unmasked and the
    masked tile loops of the forward and of both backward kernels run; (2, 128): GQA."""
    q = torch.randn(2, 4, 300, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(2, kv_heads, 300, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        for _ in "kv"
    )
    out = K.attention(q, k, v, causal=causal)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, enable_gqa=kv_heads != 4)
    torch.testing.assert_close(out, ref.to(dtype), **GRAD_TOL[dtype])
    do = torch.randn_like(out)
    for g, g_ref in zip(
        torch.autograd.grad(out, (q, k, v), do),
        torch.autograd.grad(ref, (q64, k64, v64), do.double()),
    ):
        torch.testing.assert_close(
            g, g_ref.to(dtype), atol=4 * GRAD_TOL[dtype]["atol"], rtol=4 * GRAD_TOL[dtype]["rtol"]
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_document_masked_attention_vs_masked_sdpa(dtype):
    """Packed documents (GQA, 300 tokens in documents of 1 to 150): the compiled kernel with its
    skipped tiles against SDPA with the block-diagonal mask in float64."""
    lengths = [[1, 149, 150], [37, 63, 100, 100]]
    docs = torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]
    ).cuda()
    q = torch.randn(2, 4, 300, 64, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(2, 2, 300, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in "kv"
    )
    out = K.attention(q, k, v, causal=True, document_ids=docs)
    mask = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(
        300, 300, dtype=torch.bool, device="cuda"
    ).tril()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref.to(dtype), **GRAD_TOL[dtype])
    do = torch.randn_like(out)
    for g, g_ref in zip(
        torch.autograd.grad(out, (q, k, v), do),
        torch.autograd.grad(ref, (q64, k64, v64), do.double()),
    ):
        torch.testing.assert_close(
            g, g_ref.to(dtype), atol=4 * GRAD_TOL[dtype]["atol"], rtol=4 * GRAD_TOL[dtype]["rtol"]
        )


def test_sparse_and_memory_kernels():
    dense = torch.randn(300, 500, device="cuda") * (torch.rand(300, 500, device="cuda") < 0.05)
    X = torch.randn(500, 64, device="cuda")
    want = (dense.double() @ X.double()).float()
    for fmt in (K.CSRMatrix, K.ELLMatrix):
        a = fmt.from_dense(dense)
        torch.testing.assert_close(K.spmm(a, X), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(K.spmv(a, X[:, 0]), want[:, 0], atol=1e-4, rtol=1e-4)
    x = torch.randn(1000, 777, device="cuda")
    for flag in (True, False):
        assert torch.equal(K.copy(x, coalesced=flag), x)
        assert torch.equal(K.transpose(x, tiled=flag), x.t().contiguous())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_kernel_vs_reference(dtype):
    """64 sequences over a shuffled pool of 16-token blocks: decodes of 1..2000 keys and a few
    prefill chunks, grouped-query heads, the compiled kernel against the reference."""
    from tests.helpers.paged import scatter_to_pool

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 2000, (64,), generator=g).tolist()
    new = [min(n, 1 if i % 8 else 37) for i, n in enumerate(lens)]
    c = scatter_to_pool(context_lens=lens, new_tokens=new, heads=8, kv_heads=2, head_dim=64,
                        block_size=16, dtype=dtype, seed=1)  # fmt: skip
    cuda = [t.cuda() for t in (c.q, c.k_cache, c.v_cache, c.block_tables, c.query_start,
                               c.context_lens)]  # fmt: skip
    layout = K.PagedLayout(*cuda[3:], 16)
    got = K.paged_attention(*cuda[:3], layout, backend="triton")
    want = K.paged_attention(*cuda[:3], layout, backend="torch")
    torch.testing.assert_close(got, want, **TOL[dtype])
