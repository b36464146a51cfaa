"""Document masking (Done-when 3) for GPT and Llama through each attention path one process has:
SDPA with a block-diagonal mask (the default ops), the memory-efficient attention that
recomputes probabilities in backward, and the quadratic math baseline. Tensor + sequence
parallelism: ``tests/parallel/tensor/test_document_mask.py``; the Triton kernel under the
interpreter: ``tests/kernels/interpreter/test_attention.py``.

Oracle: each document run alone through the same model (fp32, atol 1e-5); gradients of the
memory-efficient path against SDPA's (atol 1e-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlab.models import build_model
from llmlab.parallel.memory import use_math_attention, use_recompute_attention
from tests.models.document_mask_common import MODELS, TOL, check, packed_rows

PATHS = {
    "sdpa": lambda m: m,
    "recompute": lambda m: (use_recompute_attention(m, block_size=8), m)[1],
    "math": lambda m: (use_math_attention(m), m)[1],
}


def make(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(MODELS[arch]).eval()


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("arch", list(MODELS))
def test_a_token_sees_only_its_document(arch, path):
    model = PATHS[path](make(arch))

    def logits_of(ids, docs):
        return model(ids) if docs is None else model(ids, document_ids=docs)

    check(logits_of)


@pytest.mark.parametrize("arch", list(MODELS))
def test_recompute_attention_gradients_match_sdpa_with_documents(arch):
    ids, docs = packed_rows()
    targets = torch.roll(ids, -1, dims=1)
    grads = []
    for path in ("sdpa", "recompute"):
        model = PATHS[path](make(arch)).train()
        logits = model(ids, document_ids=docs)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, **TOL, msg=name)


@pytest.mark.parametrize("arch", list(MODELS))
def test_document_ids_are_refused_where_they_mean_nothing(arch):
    model = make(arch)
    ids, docs = packed_rows()
    with pytest.raises(ValueError, match="non-decreasing"):
        model(ids, document_ids=docs.flip(1))
    with pytest.raises(ValueError, match="KV cache or an attention_mask"):
        model(ids, attention=model.new_cache(2, 32), document_ids=docs)
    with pytest.raises(ValueError, match="one id per token"):
        model(ids, document_ids=docs[:, :5])
