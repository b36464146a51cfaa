"""``read_weights`` reads a pipeline stage's layers and a tensor-parallel rank's slices only:
each piece equals the full tensor cut the way ``llmlab.parallel.tensor`` cuts it
(``chunk(world, dim)[rank]``), and the bytes read are exactly the pieces' bytes."""

from __future__ import annotations

import pytest
import torch

from llmlab.models import from_pretrained
from llmlab.models.hf import CheckpointFolder, Shard, read_weights, tensor_parallel_shards
from tests.helpers.hf_tiny import save_variant


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("slices")
    names = ("llama-gqa-bias-sharded", "gpt2-untied-sharded", "qwen3-qknorm-headdim")
    return {n: save_variant(n, root)[1] for n in names}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize(
    "name", ["llama-gqa-bias-sharded", "gpt2-untied-sharded", "qwen3-qknorm-headdim"]
)
@pytest.mark.parametrize("world", [2, 4])
def test_a_stage_and_rank_read_exactly_their_slices(name, world, saved):
    full_model = from_pretrained(saved[name])
    full = full_model.state_dict()
    plan = full_model.tensor_parallel_plan()
    stage = [n for n in full if n.startswith("blocks.1.")]  # layers [1, 2)
    folder = CheckpointFolder(saved[name])
    for rank in range(world):
        shards = tensor_parallel_shards(plan, stage, rank, world)
        assert shards, "the plan shards something in every block"
        before = folder.bytes_read
        got = read_weights(folder, full_model.config, stage, shards)
        assert folder.bytes_read - before == _nbytes(got)  # nothing read beyond the pieces
        for n in stage:
            expected = full[n]
            if n in shards:
                expected = expected.chunk(world, shards[n].dim)[rank]
            assert torch.equal(got[n], expected), (n, rank)
    # Over all ranks: each sharded tensor read once, each replicated one (norms, row-parallel
    # biases) once per rank.
    sharded = {n for n in stage if n in tensor_parallel_shards(plan, stage, 0, world)}
    stage_bytes = _nbytes({n: full[n] for n in stage})
    replicated = _nbytes({n: full[n] for n in stage if n not in sharded})
    assert folder.bytes_read == stage_bytes - replicated + world * replicated


def test_embedding_and_head_shard_by_vocabulary_rows(saved):
    model = from_pretrained(saved["llama-gqa-bias-sharded"])
    names = ["embed.tokens.weight", "head.lm_head.weight"]
    shards = tensor_parallel_shards(model.tensor_parallel_plan(), names, 1, 2)
    assert shards == {n: Shard(0, 1, 2) for n in names}
    got = read_weights(saved["llama-gqa-bias-sharded"], model.config, names, shards)
    assert torch.equal(got["head.lm_head.weight"], model.head.lm_head.weight[48:])


def test_a_qkv_shard_must_hold_whole_heads(saved):
    model = from_pretrained(saved["gpt2-untied-sharded"])
    with pytest.raises(ValueError, match="whole heads"):
        read_weights(
            saved["gpt2-untied-sharded"],
            model.config,
            ["blocks.0.attn.qkv.weight"],
            {"blocks.0.attn.qkv.weight": Shard(0, 0, 8)},  # 96 rows / 8 = 12: not 3·8
        )
    with pytest.raises(ValueError, match="must divide evenly"):
        read_weights(
            saved["gpt2-untied-sharded"],
            model.config,
            ["blocks.0.mlp.fc.weight"],
            {"blocks.0.mlp.fc.weight": Shard(0, 0, 5)},
        )
