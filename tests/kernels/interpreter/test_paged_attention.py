"""The paged-attention Triton kernel under the interpreter vs contiguous attention.

The oracle is ``F.scaled_dot_product_attention`` on each sequence's keys laid out contiguously
(the cache a non-paged decoder keeps), computed in float64; the kernel reads the same keys
scattered over shuffled pool blocks. Tolerance: 1e-5 in float32 (the issue's bound; O(1)
values, an online softmax over at most ~40 keys), 2e-2 in bfloat16 (inputs rounded to bf16,
fp32 arithmetic inside, output rounded once).
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels import paged_attention
from tests.helpers.paged import contiguous_attention, scatter_to_pool


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (2, 1)], ids=["mha", "gqa"])
def test_kernel_matches_contiguous_attention(dtype, tol, heads, kv_heads):
    # three sequences: a prefill chunk with a cached prefix, a decode step, a fresh prompt
    case = scatter_to_pool(
        context_lens=[19, 33, 7], new_tokens=[5, 1, 7], heads=heads, kv_heads=kv_heads,
        head_dim=24, block_size=8, dtype=dtype, seed=0,
    )  # fmt: skip
    out = paged_attention(*case.args, backend="triton")
    want = contiguous_attention(case)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def test_kernel_equals_reference_on_decode_batch():
    case = scatter_to_pool(
        context_lens=[1, 9, 16, 17], new_tokens=[1, 1, 1, 1], heads=2, kv_heads=1,
        head_dim=16, block_size=4, dtype=torch.float32, seed=1,
    )  # fmt: skip
    kernel = paged_attention(*case.args, backend="triton")
    reference = paged_attention(*case.args, backend="torch")
    torch.testing.assert_close(kernel, reference, atol=1e-6, rtol=1e-6)


def test_the_serving_engine_decodes_the_same_tokens_on_the_kernel():
    """The whole engine with ``attention_backend="triton"`` (prefill chunks, decodes, a
    preemption-free small batch) against the same engine on the reference."""
    from llmlab.decoding import GenerationConfig
    from llmlab.models import GPT, GPTConfig
    from llmlab.serving import LLM

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [5, 5, 5]]
    config = GenerationConfig(max_new_tokens=4)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model, block_size=4, num_blocks=16, max_num_seqs=4,
                  max_num_batched_tokens=8, attention_backend=backend)  # fmt: skip
        outs[backend] = [c.token_ids for c in llm.generate(prompts, config, progress=False)]
    assert outs["triton"] == outs["torch"]
