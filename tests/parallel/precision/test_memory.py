"""Memory reuse: recompute attention vs SDPA, saved-bytes scaling in T, activation checkpointing.

Oracles: torch.nn.functional.scaled_dot_product_attention (outputs and gradients, fp32, 1e-5),
torch.autograd.gradcheck (fp64), and the un-checkpointed model's own gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlab.models import GPT, GPTConfig
from llmlab.parallel.memory import (
    apply_activation_checkpointing,
    apply_memory_options,
    math_attention,
    memory_efficient_attention,
    saved_activation_bytes,
    use_math_attention,
    use_recompute_attention,
)

SMALL = dict(vocab_size=64, block_size=512, n_layer=2, n_head=2, n_embd=32)


def qkv(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T, block", [(100, 32), (64, 64), (33, 128)])
def test_matches_sdpa_outputs_and_grads(causal: bool, T: int, block: int) -> None:
    q, k, v = qkv((2, 3, T, 16))
    out = memory_efficient_attention(q, k, v, causal=causal, block_size=block)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    theirs = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2], ids=["multi-query", "grouped-query"])
def test_grouped_query_attention_matches_sdpa_enable_gqa(kv_heads: int) -> None:
    """k and v with fewer heads than q (Llama's GQA): SDPA's ``enable_gqa`` is the oracle for
    outputs and for the k/v gradients, which sum over each key/value head's query group."""
    q = qkv((2, 4, 50, 8))[0]
    _, k, v = qkv((2, kv_heads, 50, 8), seed=1)
    out = memory_efficient_attention(q, k, v, causal=True, block_size=16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(math_attention(q, k, v), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    theirs = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_math_attention_matches_sdpa() -> None:
    q, k, v = qkv((1, 2, 40, 8))
    torch.testing.assert_close(
        math_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    )


def test_gradcheck_fp64() -> None:
    q, k, v = qkv((1, 2, 11, 4), dtype=torch.float64)
    fn = lambda q, k, v: memory_efficient_attention(q, k, v, True, block_size=4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_bad_inputs_are_named() -> None:
    q, k, v = qkv((1, 2, 8, 4))
    with pytest.raises(ValueError, match=r"dropout_p=0\.1"):
        memory_efficient_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="block_size"):
        memory_efficient_attention(q, k, v, block_size=0)
    with pytest.raises(ValueError, match=r"\(B, H, T, D\)"):
        memory_efficient_attention(q[0], k[0], v[0])
    _, k3, v3 = qkv((1, 3, 8, 4))
    with pytest.raises(ValueError, match="H_kv dividing H"):  # 3 k/v heads for 2 query heads
        memory_efficient_attention(q, k3, v3)


def attn_bytes(T: int, swap) -> int:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    if swap is not None:
        swap(model)
    x = torch.randint(0, 64, (1, T))
    return saved_activation_bytes(model, x).under("blocks.0.attn")


def test_saved_bytes_linear_for_recompute_quadratic_for_math_attention() -> None:
    Ts = (128, 256, 512)
    ours = [attn_bytes(T, use_recompute_attention) for T in Ts]
    math_ = [attn_bytes(T, use_math_attention) for T in Ts]
    # linear: bytes(T) = a·T exactly (q, k, v, out: 4·H·D per token; lse: H per token; fp32)
    assert ours[1] == 2 * ours[0] and ours[2] == 2 * ours[1]
    H, D = SMALL["n_head"], SMALL["n_embd"] // SMALL["n_head"]
    assert ours[0] == 128 * (4 * H * D + H) * 4 + 128 * H * D * 4  # + the proj input (y view)
    # quadratic: bytes(T) = a·T + b·T² with b > 0 — the second difference is positive and the
    # T² part is exactly the H×T×T fp32 probability matrices (scores are saved once by softmax
    # and the probabilities once for P·V: 2 matrices).
    b = ((math_[2] - 2 * math_[1]) - 2 * (math_[1] - 2 * math_[0])) / (2 * 256**2 - 2 * 2 * 128**2)
    assert b > 0
    assert math_[2] / math_[0] > 8  # ~16 for the T² term; a linear one would give 4
    for T, m, o in zip(Ts, math_, ours, strict=True):
        assert m > o, f"T={T}: math attention should save more than recompute attention"


def _recompute_matches_standard(make, layers: int, x: torch.Tensor, **options) -> None:
    """A model from ``make()`` with recompute attention against an identical one with the
    standard attention: logits, and every parameter's gradient of a loss on them."""
    torch.manual_seed(0)
    ref = make()
    ours = make()
    ours.load_state_dict(ref.state_dict())
    assert use_recompute_attention(ours, **options) == layers  # one attention per block
    a, b = ref(x), ours(x)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    a.square().mean().backward()
    b.square().mean().backward()
    for (n, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_recompute_attention_model_matches_standard() -> None:
    x = torch.randint(0, 64, (2, 96))
    _recompute_matches_standard(lambda: GPT(GPTConfig(**SMALL)), SMALL["n_layer"], x)


def test_recompute_attention_llama_with_grouped_query_attention_matches_standard() -> None:
    """Llama with 4 query and 2 key/value heads: recompute attention gives SDPA's logits and
    every parameter's gradient (the k/v projections' too, summed over the groups)."""
    from llmlab.models.llama import Llama, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
        intermediate_size=64,
    )  # fmt: skip
    x = torch.randint(0, 64, (2, 48))
    _recompute_matches_standard(lambda: Llama(config), config.n_layer, x, block_size=16)


def test_activation_checkpointing_saved_bytes_factor_and_exact_grads() -> None:
    """Design (memory.py docstring): ~16·B·T·C elements per block without checkpointing,
    B·T·C (the block input) with it."""
    cfg = dict(SMALL, n_layer=3)
    B, T, C = 1, 128, cfg["n_embd"]
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**cfg))
    ac = GPT(GPTConfig(**cfg))
    ac.load_state_dict(ref.state_dict())
    assert apply_activation_checkpointing(ac, every=1) == [0, 1, 2]
    assert ac.state_dict().keys() == ref.state_dict().keys()
    x = torch.randint(0, 64, (B, T))
    plain = saved_activation_bytes(ref, x)
    ckpt = saved_activation_bytes(ac, x)
    unit = B * T * C * 4
    for i in range(3):
        per_block, per_block_ac = plain.under(f"blocks.{i}"), ckpt.under(f"blocks.{i}")
        assert per_block >= 16 * unit  # the design's count
        assert per_block_ac == unit  # only the block input
        assert per_block / per_block_ac >= 16
    ref(x).square().mean().backward()
    ac(x).square().mean().backward()
    for (n, p), q in zip(ref.named_parameters(), ac.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad), n


def test_checkpointing_every_second_block_and_memory_options() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(SMALL, n_layer=4)))
    applied = apply_memory_options(
        model, activation_checkpointing={"every": 2}, recompute_attention=True
    )
    assert applied == {"recompute_attention": 4, "activation_checkpointing": [1, 3]}
    x = torch.randint(0, 64, (1, 64))
    saved = saved_activation_bytes(model, x)
    assert saved.under("blocks.1") == saved.under("blocks.3") == 64 * 32 * 4
    assert saved.under("blocks.0") > 10 * saved.under("blocks.1")
    with torch.no_grad():  # checkpointed blocks still run for inference
        assert model(x).shape == (1, 64, 64)
    with pytest.raises(ValueError, match=r"unknown memory option\(s\) \['recompute'\]"):
        apply_memory_options(model, recompute=True)
    with pytest.raises(ValueError, match="positive integer, got 0"):
        apply_activation_checkpointing(model, every=0)
    # A model without the contract's method is refused, naming what it lacks.
    with pytest.raises(TypeError, match=r"Linear cannot be used for activation checkpointing: "
                       r"it has no repeated_blocks\(\)"):  # fmt: skip
        apply_activation_checkpointing(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"no swap_attention\(\)"):
        use_recompute_attention(torch.nn.Linear(2, 2))


def test_saved_bytes_per_module_and_loss() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    x = torch.randint(0, 64, (2, 32))
    y = torch.randint(0, 64, (2, 32))
    plain = saved_activation_bytes(model, x)
    with_loss = saved_activation_bytes(
        model, (x, y), lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())
    )
    assert with_loss.total_bytes > plain.total_bytes  # the loss saves the logits' softmax
    assert plain.total_bytes == sum(plain.per_module.values())
    # MLP: fc input (C), gelu input (4C), proj input (4C) per token, fp32
    assert plain.under("blocks.0.mlp") == 2 * 32 * (1 + 4 + 4) * 32 * 4
    assert all(not p.requires_grad or p.grad is None for p in model.parameters())
