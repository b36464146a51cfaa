"""The distributed test helper itself: results come back by rank, failures carry the traceback."""

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed


def _all_reduce_rank(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


@pytest.mark.distributed
def test_results_come_back_in_rank_order():
    assert run_distributed(_all_reduce_rank, 3) == [3.0, 3.0, 3.0]


@pytest.mark.distributed
def test_a_failing_rank_reports_its_traceback():
    with pytest.raises(AssertionError, match="boom on rank one"):
        run_distributed(_fail_on_rank_one, 2, timeout=60)


def _tensor_result(rank: int, world_size: int) -> torch.Tensor:
    return torch.full((3,), float(rank))


@pytest.mark.distributed
def test_tensor_results_outlive_their_rank():
    out = run_distributed(_tensor_result, 2)
    assert torch.equal(out[1], torch.ones(3))
