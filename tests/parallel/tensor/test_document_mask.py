"""Document masking under tensor + sequence parallelism (Done-when 3), GPT and Llama (GQA).

``llmlab.parallel.tensor.parallelize(model, plan, group, sequence_parallel=True)`` on 2 gloo
ranks: the hidden state between regions is sharded along the sequence, so the document ids
(whole rows) must reach every attention beside it, not be split with it. Oracle: each document
run alone through the unsharded model, and the sharded logits unchanged when the other documents
of the row change (fp32, atol 1e-5); plus the gradients of a packed batch against one process's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmlab.models import build_model
from tests.helpers.distributed import run_distributed
from tests.models.document_mask_common import MODELS, TOL, check, packed_rows


def _both_models(rank: int, world_size: int) -> None:
    for arch in MODELS:  # one spawn for both: starting ranks costs more than the checks
        _sharded_vs_single(world_size, arch)


def _sharded_vs_single(world_size: int, arch: str) -> None:
    import torch.distributed as dist

    from llmlab.parallel.tensor import gather_from_tensor_region, parallelize

    torch.manual_seed(0)
    single = build_model(MODELS[arch]).eval()
    sharded = build_model(MODELS[arch]).eval()
    sharded.load_state_dict(single.state_dict())
    group = dist.group.WORLD
    parallelize(sharded, sharded.tensor_parallel_plan(), group, sequence_parallel=True)

    def logits_of(ids, docs):
        if docs is None:  # a document alone: the unsharded model is the reference
            return single(ids)
        return gather_from_tensor_region(sharded(ids, document_ids=docs), group)

    check(logits_of)
    # one training step's gradients, packed and masked, against one process
    ids, docs = packed_rows(seed=1)
    targets = torch.roll(ids, -1, dims=1)
    for model in (single, sharded):
        model.train()
        logits = model(ids, document_ids=docs)
        if model is sharded:
            logits = gather_from_tensor_region(logits, group)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    for name, p in sharded.named_parameters():
        grad, dim = p.grad, getattr(p, "tp_shard_dim", None)
        if dim is not None:
            parts = [torch.empty_like(grad) for _ in range(world_size)]
            dist.all_gather(parts, grad.contiguous(), group=group)
            grad = torch.cat(parts, dim=dim)
        want = dict(single.named_parameters())[name].grad
        torch.testing.assert_close(grad, want, **TOL, msg=f"{arch} {name}")


@pytest.mark.distributed
def test_document_mask_under_tensor_and_sequence_parallelism():
    run_distributed(_both_models, 2)
