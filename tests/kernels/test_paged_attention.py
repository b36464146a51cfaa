"""Paged attention's reference face vs contiguous attention, and the op's checks and dispatch.

The oracle is ``F.scaled_dot_product_attention`` in float64 over each sequence's keys laid out
contiguously; the paged op reads the same keys scattered over shuffled pool blocks (with noise
in the spare blocks). Tolerance 1e-5 in float32, as the issue asks. The Triton kernel is tested
the same way under the interpreter (tests/kernels/interpreter/test_paged_attention.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from llmlab.kernels import PagedLayout, paged_attention, triton_available
from llmlab.kernels.paged_attention import reference
from tests.helpers.paged import contiguous_attention, scatter_to_pool

CASES = {
    "prefill chunks + decodes": dict(context_lens=[19, 33, 7, 1], new_tokens=[5, 1, 7, 1]),
    # three groups of similar lengths: [40], [16, 17], [3]
    "decodes of unequal lengths": dict(context_lens=[3, 40, 16, 17], new_tokens=[1, 1, 1, 1]),
    "one whole prompt": dict(context_lens=[29], new_tokens=[29]),
    "consecutive blocks (read as slices)": dict(
        context_lens=[21, 9], new_tokens=[1, 4], shuffle=False
    ),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_reference_matches_contiguous_attention(case, heads, kv_heads):
    c = scatter_to_pool(**CASES[case], heads=heads, kv_heads=kv_heads, head_dim=16,
                        block_size=8, dtype=torch.float32, seed=3)  # fmt: skip
    out = paged_attention(*c.args, backend="torch")
    torch.testing.assert_close(out.double(), contiguous_attention(c), atol=1e-5, rtol=1e-5)


def test_torch_backend_never_warns_and_auto_falls_back_with_one_warning(monkeypatch):
    c = scatter_to_pool(context_lens=[5], new_tokens=[1], heads=2, kv_heads=2, head_dim=8,
                        block_size=4, dtype=torch.float32, seed=0)  # fmt: skip
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paged_attention(*c.args, backend="torch")
    from llmlab.kernels._runtime import reset_fallback_warnings

    reset_fallback_warnings()
    with pytest.warns(RuntimeWarning, match="paged_attention"):
        out = paged_attention(*c.args)  # auto on CPU: the reference
    torch.testing.assert_close(out, reference(*c.args))


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_backend_refuses_cpu_without_the_interpreter(monkeypatch):
    c = scatter_to_pool(context_lens=[5], new_tokens=[1], heads=2, kv_heads=2, head_dim=8,
                        block_size=4, dtype=torch.float32, seed=0)  # fmt: skip
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        paged_attention(*c.args, backend="triton")


def test_bad_inputs_name_the_values():
    c = scatter_to_pool(context_lens=[5], new_tokens=[1], heads=3, kv_heads=2, head_dim=8,
                        block_size=4, dtype=torch.float32, seed=0)  # fmt: skip
    with pytest.raises(ValueError, match="2 KV heads must divide q's 3 heads"):
        paged_attention(*c.args)
    c = scatter_to_pool(context_lens=[5], new_tokens=[1], heads=2, kv_heads=2, head_dim=8,
                        block_size=4, dtype=torch.float32, seed=0)  # fmt: skip
    with pytest.raises(ValueError, match=r"query_start \(3,\) must be \(B \+ 1,\) = \(2,\)"):
        PagedLayout(c.block_tables, torch.tensor([0, 1, 1]), c.context_lens, 4)
    with pytest.raises(ValueError, match=r"1 <= queries <= keys, got queries \[6\]"):
        PagedLayout(c.block_tables, torch.tensor([0, 6]), c.context_lens, 4)
    with pytest.raises(TypeError, match=r"v_cache is torch\.float64 but q is torch\.float32"):
        paged_attention(c.q, c.k_cache, c.v_cache.double(), c.layout)
    with pytest.raises(ValueError, match="the layout has block_size 8"):
        wrong = PagedLayout(c.block_tables, c.query_start, c.context_lens, 8)
        paged_attention(c.q, c.k_cache, c.v_cache, wrong)
    with pytest.raises(ValueError, match="backend='cuda'; valid: auto, torch, triton"):
        paged_attention(*c.args, backend="cuda")
