"""``ParallelDims``: rank order, groups and refusals. The groups built on four real ranks are
checked in ``tensor/test_gpt_tensor_parallel.py``'s four-rank spawn (one spawn per world size)."""

import pytest

from llmlab.parallel import ParallelDims


def test_layout_puts_tensor_innermost_and_covers_every_rank_once():
    dims = ParallelDims(data=2, pipeline=2, tensor=2)
    # (data, pipeline, context, tensor)
    assert [dims.coords(r) for r in range(4)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1)
    ]  # fmt: skip
    for dim in ("data", "pipeline", "context", "tensor"):
        groups = dims.group_ranks(dim)
        assert sorted(r for g in groups for r in g) == list(range(8))
    assert dims.group_ranks("tensor")[0] == [0, 1]
    assert dims.group_ranks("pipeline")[0] == [0, 2]
    assert dims.group_ranks("data")[0] == [0, 4]
    assert dims.group_ranks("context") == [[r] for r in range(8)]
    assert all(dims.rank_of(*dims.coords(r)) == r for r in range(8))


def test_context_sits_between_pipeline_and_tensor_in_the_rank_order():
    """The mesh order is data × pipeline × context × tensor (a DeviceMesh of that shape); the
    replica groups (equal weights: data × context) flatten the mesh's data and context axes."""
    from types import SimpleNamespace

    import torch

    mesh = torch.arange(24).view(2, 3, 2, 2)  # what init_device_mesh lays out for those names
    sizes = SimpleNamespace(data=2, pipeline=3, context=2, tensor=2)  # the arithmetic alone
    for rank in range(24):
        coords = ParallelDims.coords(sizes, rank)
        assert mesh[coords].item() == rank
        assert ParallelDims.rank_of(sizes, *coords) == rank
    dims = ParallelDims(data=2, context=2, tensor=2)
    flat = torch.arange(8).view(2, 2, 2).permute(2, 0, 1).reshape(2, 4)  # (tensor, data·context)
    assert dims.replica_ranks() == flat.tolist() and dims.replicas == 4


def test_bad_layouts_name_the_numbers():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by pipeline \(4\)"):
        ParallelDims(data=None, pipeline=4).resolve(6)
    with pytest.raises(ValueError, match=r"= 4, but the world size is 3"):
        ParallelDims(data=2, tensor=2).resolve(3)
    with pytest.raises(ValueError, match="tensor=0 must be a positive integer"):
        ParallelDims(tensor=0)
    with pytest.raises(ValueError, match=r"context=2 with pipeline=2: a pipeline stage never"):
        ParallelDims(context=2, pipeline=2)
    assert ParallelDims(data=None, pipeline=2).resolve(6).data == 3
