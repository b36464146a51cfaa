"""``ParallelDims``: one validated (data × pipeline × tensor) layout and its process groups.

Ranks are laid out with tensor parallelism innermost (neighbouring ranks share a tensor-parallel
group, as Megatron-LM does, so the chattiest collectives stay closest), then pipeline, then data:

    rank = (dp_index * pipeline + pp_index) * tensor + tp_index

Every strategy builds its groups from here, so a layout is checked once, with a message that
names the numbers, before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the data, pipeline and tensor dimensions; their product is the world size."""

    data: int = 1
    pipeline: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        for name in ("data", "pipeline", "tensor"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.data * self.pipeline * self.tensor

    @classmethod
    def infer(cls, world_size: int, pipeline: int = 1, tensor: int = 1) -> ParallelDims:
        """Fill in the data dimension: ``world_size / (pipeline * tensor)``, which must divide."""
        model_parallel = pipeline * tensor
        if world_size % model_parallel != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by pipeline ({pipeline}) × tensor "
                f"({tensor}) = {model_parallel}; use a world size that is a multiple of "
                f"{model_parallel}, or change the pipeline/tensor degrees"
            )
        return cls(data=world_size // model_parallel, pipeline=pipeline, tensor=tensor)

    def validate(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(
                f"data ({self.data}) × pipeline ({self.pipeline}) × tensor ({self.tensor}) = "
                f"{self.world_size}, but the world size is {world_size}"
            )

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(data, pipeline, tensor) indices of ``rank``."""
        tp = rank % self.tensor
        pp = (rank // self.tensor) % self.pipeline
        dp = rank // (self.tensor * self.pipeline)
        return dp, pp, tp

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pipeline + pp) * self.tensor + tp

    def group_ranks(self, dim: str) -> list[list[int]]:
        """All groups along ``dim`` ("data", "pipeline" or "tensor"), each a list of ranks."""
        sizes = {"data": self.data, "pipeline": self.pipeline, "tensor": self.tensor}
        if dim not in sizes:
            raise ValueError(f"unknown dimension {dim!r}; valid: {list(sizes)}")
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            dp, pp, tp = self.coords(rank)
            key = {"data": (pp, tp), "pipeline": (dp, tp), "tensor": (dp, pp)}[dim]
            groups.setdefault(key, []).append(rank)
        return list(groups.values())


@dataclass
class ProcessGroups:
    """This rank's process groups along each dimension (built collectively by every rank)."""

    dims: ParallelDims
    rank: int
    data: dist.ProcessGroup | None = field(default=None, repr=False)
    pipeline: dist.ProcessGroup | None = field(default=None, repr=False)
    tensor: dist.ProcessGroup | None = field(default=None, repr=False)
    pipeline_ranks: list[int] = field(default_factory=list)
    data_ranks: list[int] = field(default_factory=list)
    tensor_ranks: list[int] = field(default_factory=list)

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.dims.coords(self.rank)


def build_process_groups(dims: ParallelDims, backend: str | None = None) -> ProcessGroups:
    """Create every group of every dimension (``new_group`` is collective) and keep this rank's.

    Call on all ranks after ``dist.init_process_group``; fails with the numbers when the layout
    does not match the world size.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_process_groups needs torch.distributed to be initialised first")
    world, rank = dist.get_world_size(), dist.get_rank()
    dims.validate(world)
    mine = ProcessGroups(dims=dims, rank=rank)
    for dim in ("data", "pipeline", "tensor"):
        for ranks in dims.group_ranks(dim):
            group = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                setattr(mine, dim, group)
                setattr(mine, f"{dim}_ranks", ranks)
    return mine
