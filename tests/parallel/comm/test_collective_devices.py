"""Every collective allocates its scratch and result tensors on the input's device and dtype.

Why it matters: ``docs/gpu.md`` says the collectives run on CUDA tensors; a buffer allocated
without ``device=`` lands on torch's default device (the CPU), and the first ring step then
mixes a CUDA tensor with a CPU one. On a CPU-only machine that mistake is invisible (input and
default device are both the CPU), so the test makes it visible: each rank runs every collective
under ``torch.device("meta")`` (torch's default device for factory calls that name none) with a
float64 input (torch's default dtype is float32), and a ``TorchDispatchMode`` records the device
and dtype of every tensor an operator creates from no tensor input (``empty``, ``zeros``, ...).
A device-less allocation shows up as ``meta``, a dtype-less one as ``float32``. The collectives
are the real ones over gloo, and their results are checked against ``torch.distributed``'s
(float64, within 1e-12: only the summation order differs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from llmlab.parallel import comm
from tests.helpers.distributed import run_distributed

DTYPE = torch.float64  # not torch's default dtype, so a missing dtype= is seen


#: Operators that allocate from a tensor argument's metadata (device and dtype follow it unless
#: overridden); every other allocation is an operator with no tensor input (``empty``, ``zeros``).
LIKE = {"empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros",
        "new_ones", "new_full", "new_empty_strided"}  # fmt: skip


class FactoryRecorder(TorchDispatchMode):
    """Records (op, device, dtype) of every tensor an allocating operator makes, and raises at
    once when one is not on ``device`` in ``dtype``: every rank allocates the same buffers, so
    every rank stops there together instead of waiting on a peer that received into a meta
    buffer."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.device, self.dtype = device, dtype
        self.made: list[tuple[str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs, _ = tree_flatten((args, kwargs))
        allocates = func.overloadpacket.__name__ in LIKE
        if allocates or not any(isinstance(x, torch.Tensor) for x in inputs):
            outputs, _ = tree_flatten(out)
            for t in outputs:
                if isinstance(t, torch.Tensor):
                    self.made.append((str(func), str(t.device), str(t.dtype)))
                    if (t.device, t.dtype) != (self.device, self.dtype):
                        raise AssertionError(
                            f"{func} allocated a {t.dtype} tensor on {t.device}; the input is "
                            f"{self.dtype} on {self.device}"
                        )
        return out


def _collectives(x: torch.Tensor, root: int) -> dict[str, torch.Tensor]:
    """Every public collective of ``llmlab.parallel.comm`` on a copy of ``x``."""
    out = {f"all_reduce[{a}]": comm.all_reduce(x.clone(), a) for a in comm.ALL_REDUCE_ALGORITHMS}
    out["all_gather"] = comm.all_gather(x)
    out["reduce_scatter"] = comm.reduce_scatter(x)
    out["broadcast"] = comm.broadcast(x.clone(), src=root)
    out["reduce"] = comm.reduce(x.clone(), dst=root)
    return out


def _references(x: torch.Tensor, root: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    ref = x.clone()
    dist.all_reduce(ref)
    out = {f"all_reduce[{a}]": ref for a in comm.ALL_REDUCE_ALGORITHMS}
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x)
    out["all_gather"] = torch.stack(gathered)
    pieces = list(torch.tensor_split(x.clone(), world))
    out["reduce_scatter"] = torch.empty_like(pieces[rank])
    dist.reduce_scatter(out["reduce_scatter"], pieces)
    out["broadcast"] = x.clone()
    dist.broadcast(out["broadcast"], src=root)
    if rank == root:
        out["reduce"] = ref
    return out


def _run_under_meta_default(rank: int, world: int, n: int) -> dict:
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank), dtype=DTYPE)
    root = world - 1
    recorder = FactoryRecorder(x.device, x.dtype)
    with torch.device("meta"), recorder:
        ours = _collectives(x, root)
    refs = _references(x, root, rank, world)
    return {
        "made": recorder.made,
        "results": {k: (str(v.device), v.dtype) for k, v in ours.items()},
        "mismatch": [
            k for k, ref in refs.items() if not torch.allclose(ours[k], ref, rtol=1e-12, atol=1e-12)
        ],
    }


@pytest.mark.distributed
def test_collectives_allocate_on_the_inputs_device_and_dtype() -> None:
    """3 ranks (odd: recursive doubling folds a rank in; uneven ring chunks), 7 elements."""
    results = run_distributed(_run_under_meta_default, 3, 7)
    for rank, found in enumerate(results):
        assert len(found["made"]) >= 5, f"the recorder saw too little: {found['made']}"
        assert all(m[1:] == ("cpu", str(DTYPE)) for m in found["made"]), found["made"]
        assert all(v == ("cpu", DTYPE) for v in found["results"].values()), found["results"]
        assert not found["mismatch"], f"rank {rank}: differs from torch.distributed: {found}"


# ----------------------------------------------------------------------------------- CUDA


def _on_cuda(rank: int, world: int) -> dict:
    """Every collective on CUDA tensors over NCCL, against NCCL's own collectives."""
    x = torch.randn(1001, dtype=DTYPE, device=f"cuda:{rank}")
    ours = _collectives(x, world - 1)
    refs = _references(x, world - 1, rank, world)
    return {
        "devices": {k: str(v.device) for k, v in ours.items()},
        "mismatch": [k for k, r in refs.items() if not torch.allclose(ours[k], r, 1e-12, 1e-12)],
    }


@pytest.mark.gpu
@pytest.mark.distributed
def test_collectives_on_cuda_tensors_over_nccl() -> None:
    """The same collectives on CUDA tensors, one rank per GPU (NCCL refuses two ranks on one
    GPU, so this needs two), against NCCL's; results must stay on each rank's GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: NCCL runs one rank per GPU")
    results = run_distributed(_on_cuda, 2, backend="nccl")
    for rank, found in enumerate(results):
        assert set(found["devices"].values()) == {f"cuda:{rank}"}, found
        assert not found["mismatch"], found


@pytest.mark.gpu
def test_collectives_on_a_cuda_tensor_in_a_one_rank_group() -> None:
    """One GPU: a one-rank group still allocates the result (all_gather) and scratch; every
    output must be a CUDA tensor equal to the input's contribution."""
    results = run_distributed(_on_cuda, 1, backend="nccl")
    assert set(results[0]["devices"].values()) == {"cuda:0"}, results
    assert not results[0]["mismatch"], results
