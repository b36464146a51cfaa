"""The fused CPU SwiGLU (``llmlab.kernels.cpu_swiglu``) and the models' ``kernels="cpu"`` table.

The oracle is PyTorch's own ``F.silu(a) * b`` with autograd: the kernel repeats its arithmetic op
for op, so forward and both gradients must be equal bit for bit (sizes with and without a tail
of single values after the vector loop, and one big enough to be split across threads). Models
built with ``kernels="cpu"`` must give the ``kernels="torch"`` model's logits and gradients."""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels.cpu_extension import cpu_kernels
from llmlab.kernels.cpu_swiglu import cpu_swiglu, fused_applies
from llmlab.kernels.swiglu import reference
from llmlab.models import Llama, LlamaConfig
from llmlab.models.gpt_config import GPTConfig
from llmlab.models.moe import MoE, MoEConfig
from llmlab.models.ops import get_ops

needs_kernel = pytest.mark.skipif(
    cpu_kernels() is None, reason="llmlab's C++ CPU kernels are not built here (no AVX2/compiler)"
)


@needs_kernel
@pytest.mark.parametrize("shape", [(4, 64), (7, 33), (3, 5, 101), (80, 1024)])
def test_forward_and_gradients_equal_pytorchs_bit_for_bit(shape):
    torch.manual_seed(0)
    a, b, g = torch.randn(shape) * 4, torch.randn(shape), torch.randn(shape)
    fused_a, fused_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    eager_a, eager_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    assert fused_applies(fused_a, fused_b)
    fused = cpu_swiglu(fused_a, fused_b)
    eager = reference(eager_a, eager_b)
    fused.backward(g)
    eager.backward(g)
    assert torch.equal(fused, eager)
    assert torch.equal(fused_a.grad, eager_a.grad)
    assert torch.equal(fused_b.grad, eager_b.grad)
    with torch.no_grad():  # the no-graph path: the same forward
        assert torch.equal(cpu_swiglu(a, b), eager.detach())


def test_other_inputs_take_pytorchs_ops():
    a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    assert not fused_applies(a, b)
    assert torch.equal(cpu_swiglu(a, b), reference(a, b))

    class Sub(torch.Tensor):  # a tensor subclass (as a DTensor is) keeps PyTorch's ops
        pass

    sub = torch.randn(4, 8).as_subclass(Sub)
    assert not fused_applies(sub, sub)
    # not contiguous: copied, still fused (PyTorch's strided loop may take its scalar exp, so
    # equal to rounding here, not bit for bit)
    a32 = torch.randn(8, 8)[:, ::2]
    torch.testing.assert_close(cpu_swiglu(a32, a32), reference(a32, a32), rtol=1e-6, atol=1e-7)


@needs_kernel
def test_the_kernel_refuses_mismatched_tensors():
    with pytest.raises(RuntimeError, match="swiglu: b has shape"):
        cpu_kernels().swiglu_forward(torch.randn(4, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="contiguous float32 CPU tensor"):
        cpu_kernels().swiglu_forward(torch.randn(4, 8).double(), torch.randn(4, 8).double())


def _llama(kernels: str, **extra) -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_kv_head=2,
                         n_embd=64, intermediate_size=160, kernels=kernels, **extra)  # fmt: skip
    return Llama(config)


@pytest.mark.parametrize(
    "extra",
    [{}, {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}],
    ids=["dense", "moe"],
)
def test_llama_with_the_cpu_table_equals_torch_ops(extra):
    """Logits and every gradient of a dense and an MoE Llama equal the torch-op model's."""
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = {}
    for kernels in ("torch", "cpu"):
        model = _llama(kernels, **extra)
        logits = model(ids)
        logits.square().mean().backward()
        grads[kernels] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(grads["cpu"][0], grads["torch"][0], rtol=0, atol=0)
    for name, grad in grads["torch"][1].items():
        torch.testing.assert_close(grads["cpu"][1][name], grad, rtol=0, atol=0, msg=name)


def test_the_moe_block_takes_the_tables_swiglu():
    config = MoEConfig(dim=32, num_experts=4, top_k=2, intermediate_size=48)
    assert MoE(config, get_ops("cpu")).experts.swiglu is cpu_swiglu


def test_gpt_refuses_the_cpu_table():
    """GPT has no op the "cpu" table replaces: asking for it would change nothing."""
    with pytest.raises(ValueError, match=r"kernels='cpu' is not one of \['torch', 'triton'\]"):
        config = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
        config.kernels = "cpu"
        config.validate()
