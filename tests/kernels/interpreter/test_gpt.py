"""Done-when 2: a GPT with ``kernels="triton"`` (LayerNorm, GELU and attention run as Triton
kernels through the interpreter) gives the loss and gradients of ``kernels="torch"``.

Tolerance (fp32, 2 layers, d=32): loss atol 1e-5; every parameter gradient atol 1e-5,
rtol 1e-4 (the kernels sum in a different order than torch's CPU ops).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from llmlab.kernels._runtime import reset_fallback_warnings
from llmlab.models import GPT, GPTConfig


def loss_and_grads(model, ids, targets):
    model.zero_grad(set_to_none=True)
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gpt_triton_kernels_match_torch_ops():
    common = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**common, kernels="torch"))
    fused = GPT(GPTConfig(**common, kernels="triton"))
    fused.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 64, (2, 13))
    targets = torch.randint(0, 64, (2, 13))

    reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_k, grads_k = loss_and_grads(fused, ids, targets)
    fallbacks = [w for w in caught if "llmlab.kernels" in str(w.message)]
    assert not fallbacks, f"the reference ran instead of the kernels: {fallbacks[0].message}"

    loss_t, grads_t = loss_and_grads(ref, ids, targets)
    torch.testing.assert_close(loss_k, loss_t, atol=1e-5, rtol=0)
    assert grads_k.keys() == grads_t.keys()
    for name in grads_t:
        torch.testing.assert_close(
            grads_k[name], grads_t[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_compiled_blocks_run_the_interpreted_kernels_as_graph_breaks():
    """``compile=true`` with ``kernels="triton"`` under the interpreter: each interpreted kernel
    is a graph break (dynamo cannot trace Triton's interpreter, and failed on
    ``tl.load`` before), so the compiled GPT computes what the eager one does."""
    from llmlab.parallel.compile import compile_blocks

    common = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}
    torch.manual_seed(0)
    eager = GPT(GPTConfig(**common, kernels="triton"))
    compiled = GPT(GPTConfig(**common, kernels="triton"))
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    compile_blocks(compiled, backend="aot_eager")
    ids, targets = torch.randint(0, 64, (2, 13)), torch.randint(0, 64, (2, 13))
    loss_e, grads_e = loss_and_grads(eager, ids, targets)
    loss_c, grads_c = loss_and_grads(compiled, ids, targets)
    torch.testing.assert_close(loss_c, loss_e, atol=1e-6, rtol=0)
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_c[name], grad, atol=1e-6, rtol=1e-5, msg=name)
