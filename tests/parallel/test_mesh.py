import pytest
import torch.distributed as dist

from llmlab.parallel import ParallelDims, build_process_groups
from tests.helpers.distributed import run_distributed


def test_layout_puts_tensor_innermost_and_covers_every_rank_once():
    dims = ParallelDims(data=2, pipeline=2, tensor=2)
    assert [dims.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    for dim in ("data", "pipeline", "tensor"):
        groups = dims.group_ranks(dim)
        assert sorted(r for g in groups for r in g) == list(range(8))
    assert dims.group_ranks("tensor")[0] == [0, 1]
    assert dims.group_ranks("pipeline")[0] == [0, 2]
    assert dims.group_ranks("data")[0] == [0, 4]
    assert all(dims.rank_of(*dims.coords(r)) == r for r in range(8))


def test_bad_layouts_name_the_numbers():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by pipeline \(4\)"):
        ParallelDims.infer(6, pipeline=4)
    with pytest.raises(ValueError, match=r"= 4, but the world size is 3"):
        ParallelDims(data=2, tensor=2).validate(3)
    with pytest.raises(ValueError, match="tensor must be a positive integer"):
        ParallelDims(tensor=0)


def _groups(rank, world):
    pg = build_process_groups(ParallelDims(data=2, tensor=2))
    return dist.get_world_size(pg.tensor), pg.tensor_ranks, pg.data_ranks


@pytest.mark.distributed
def test_process_groups_on_four_ranks():
    out = run_distributed(_groups, 4)
    assert out[0] == (2, [0, 1], [0, 2])
    assert out[3] == (2, [2, 3], [1, 3])
