"""Llama's ops in the suite's process (no interpreter): the CPU fallback and input validation.

The fallback is what CPU training with ``kernels="triton"`` runs: each op must give HF's
arithmetic (float32, atol/rtol 1e-6: the same torch ops run underneath) and warn once.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import llmlab.kernels as K
from llmlab.kernels._runtime import interpreter_requested, reset_fallback_warnings


@pytest.mark.skipif(interpreter_requested(), reason="tests the non-interpreter CPU fallback")
def test_cpu_fallback_matches_torch_and_warns_once_per_op():
    torch.manual_seed(0)
    x, w = torch.randn(2, 7, 3, 16), torch.randn(16)
    k = torch.randn(2, 7, 1, 16)
    angles = torch.randn(1, 7, 8)
    cos, sin = angles.cos(), angles.sin()
    reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            norm = K.rms_norm(x, w, 1e-6)
            q_rot, k_rot = K.rope(x, k, cos, sin)
            act = K.swiglu(x, w.expand_as(x))
            gqa = K.attention(x.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))
    torch.testing.assert_close(norm, F.rms_norm(x, (16,), w, 1e-6), atol=1e-6, rtol=1e-6)
    x1, x2 = x.chunk(2, -1)
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    torch.testing.assert_close(q_rot, torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1))
    k1, k2 = k.chunk(2, -1)
    torch.testing.assert_close(k_rot, torch.cat((k1 * c - k2 * s, k2 * c + k1 * s), -1))
    torch.testing.assert_close(act, F.silu(x) * w)
    kk = k.transpose(1, 2).expand(2, 3, 7, 16)  # the oracle repeats the single KV head
    ref = F.scaled_dot_product_attention(x.transpose(1, 2), kk, kk, is_causal=True)
    torch.testing.assert_close(gqa, ref, atol=1e-6, rtol=1e-6)
    ops = sorted(str(c.message).split(":")[0] for c in caught if "llmlab.kernels" in str(c.message))
    assert ops == [f"llmlab.kernels.{n}" for n in ("attention", "rms_norm", "rope", "swiglu")]


def test_bad_inputs_name_the_shapes():
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"rope: head dim 7 must be even"):
        K.rope(
            torch.randn(1, 4, 3, 7),
            torch.randn(1, 4, 1, 7),
            torch.ones(1, 4, 3),
            torch.ones(1, 4, 3),
        )
    with pytest.raises(
        ValueError, match=r"rope: cos must have shape \(1 or 1, 4, 4\), got \(1, 5, 4\)"
    ):
        K.rope(q, q, torch.ones(1, 5, 4), torch.ones(1, 5, 4))
    with pytest.raises(ValueError, match=r"rms_norm: weight must have shape \(8,\), got \(4,\)"):
        K.rms_norm(q, torch.ones(4))
    with pytest.raises(ValueError, match=r"swiglu: a is \(1, 4, 3, 8\) .* b is \(1, 4, 3, 4\)"):
        K.swiglu(q, q[..., :4])
    with pytest.raises(ValueError, match=r"k's 3 heads must divide q's 4"):
        K.attention(torch.randn(1, 4, 5, 8), torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8))
