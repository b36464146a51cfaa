"""``ParallelDims``: the one validated layout (data × pipeline × context × tensor), and its groups.

Ranks are laid out with tensor parallelism innermost (neighbouring ranks share a tensor-parallel
group, as Megatron-LM does, so the chattiest collectives stay closest), then context, then
pipeline, then data -- the order of a ``DeviceMesh`` of shape ``(data, pipeline, context, tensor)``:

    rank = ((dp · pipeline + pp) · context + cp) · tensor + tp

``expert`` is not a fifth dimension: it splits the ``data × context`` ranks of each (pipeline,
tensor) position (torchtitan's and Megatron-Core's expert-parallel mesh), so the world size stays
``data × pipeline × context × tensor``. The replica index ``i = dp · context + cp`` of a rank
puts it in the expert group of the ``expert`` neighbouring replicas ``i // expert`` (they hold
the experts' ``expert`` slices and exchange tokens) at expert index ``i % expert``; the ranks with
the same expert index (``data × context / expert`` of them) hold a copy of the same experts and
reduce those experts' gradients together (:mod:`llmlab.parallel.expert`).

A layout is built once from the strategy's options (``NDParallelStrategy`` builds it from its
arguments; the app's config check builds it through the strategy's ``check_config``) and every
caller -- the app, the strategy, ``parallelize_model`` -- judges it with :func:`check_layout`, the
one function that raises a :class:`LayoutError`. So a layout that cannot run on this world, this
batch or this model is refused with the same message wherever it is found first, naming the
numbers, before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch.distributed as dist
from torch import nn

from llmlab.parallel.contracts import (
    PipelineSplittable,
    TensorParallelShardable,
    require,
    tensor_parallel_problems,
)
from llmlab.parallel.schedule_args import V_SHAPED, validate_schedule_args

DIMS = ("data", "pipeline", "context", "tensor")  # outermost first; tensor innermost


class LayoutError(ValueError):
    """A layout that cannot run here: every problem found, each naming its numbers."""


class Coords(NamedTuple):
    """One rank's index along each dimension."""

    data: int
    pipeline: int
    context: int
    tensor: int


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the four dimensions, and how the pipeline and tensor dimensions run.

    ``data=None`` takes whatever the world leaves: :meth:`resolve` fills it in. ``context``: the
    ranks one sequence is split over (ring attention, :mod:`llmlab.parallel.context`); it does
    not compose with a pipeline (stages never see the position ids). ``microbatches`` defaults
    to 4 with a pipeline, else 1; ``virtual_stages`` to 2 for the interleaved and V-shaped
    schedules, else 1. ``boundaries``: the first layer index of every virtual stage after the
    first (``None``: balanced by parameter count). ``expert``: the ranks of data × context
    each mixture-of-experts layer's experts are split over (module docstring); it must divide
    data × context and adds no rank.
    """

    data: int | None = 1
    pipeline: int = 1
    context: int = 1
    tensor: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int | None = None
    virtual_stages: int | None = None
    boundaries: tuple[int, ...] | None = None
    expert: int = 1  # ranks the experts are split over, taken from data × context

    def __post_init__(self) -> None:
        if self.microbatches is None:
            pipelined = isinstance(self.pipeline, int) and self.pipeline > 1
            object.__setattr__(self, "microbatches", 4 if pipelined else 1)
        if self.virtual_stages is None:
            two = self.schedule == "interleaved" or self.schedule in V_SHAPED
            object.__setattr__(self, "virtual_stages", 2 if two else 1)
        if self.boundaries is not None:
            object.__setattr__(self, "boundaries", tuple(self.boundaries))
        object.__setattr__(self, "sequence_parallel", bool(self.sequence_parallel))
        check_layout(self)

    # ------------------------------------------------------------------ the world
    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the model: pipeline × context × tensor."""
        return self.pipeline * self.context * self.tensor

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights: data × context (context ranks train one replica on
        other tokens of the same batch, so their gradients are averaged together: folded)."""
        return self._data() * self.context

    @property
    def world_size(self) -> int:
        return self._data() * self.model_parallel

    @property
    def expert_copies(self) -> int:
        """Ranks holding a copy of the same experts: data × context / expert."""
        return self.replicas // self.expert

    def expert_coords(self, rank: int) -> tuple[int, int]:
        """(expert group, expert index) of ``rank``: which ``expert`` neighbouring replicas it
        exchanges tokens with, and which slice of the experts it holds."""
        c = self.coords(rank)
        return divmod(c.data * self.context + c.context, self.expert)

    def expert_ranks(self) -> list[list[int]]:
        """The expert groups: ``expert`` neighbouring replicas of one (pipeline, tensor)
        position, ordered by expert index (they hold the experts' slices, in order)."""
        return [r[i : i + self.expert] for r in self.replica_ranks()
                for i in range(0, len(r), self.expert)]  # fmt: skip

    def expert_copy_ranks(self) -> list[list[int]]:
        """The ranks holding the same experts (one per expert group): their expert gradients
        are summed together."""
        return [r[i :: self.expert] for r in self.replica_ranks() for i in range(self.expert)]

    def resolve(self, world_size: int) -> ParallelDims:
        """This layout on ``world_size`` ranks: ``data`` filled in (or checked); raises the
        :class:`LayoutError` of :func:`check_layout` when the numbers do not fit."""
        check_layout(self, world_size=world_size)
        return (
            self if self.data is not None else replace(self, data=world_size // self.model_parallel)
        )

    def _data(self) -> int:
        if self.data is None:
            raise ValueError("ParallelDims(data=None) takes the world's size: call resolve() first")
        return self.data

    # ------------------------------------------------------------------ ranks
    def coords(self, rank: int) -> Coords:
        """(data, pipeline, context, tensor) indices of ``rank``."""
        rank, tp = divmod(rank, self.tensor)
        rank, cp = divmod(rank, self.context)
        dp, pp = divmod(rank, self.pipeline)
        return Coords(dp, pp, cp, tp)

    def rank_of(self, data: int, pipeline: int, context: int = 0, tensor: int = 0) -> int:
        return ((data * self.pipeline + pipeline) * self.context + context) * self.tensor + tensor

    def sizes(self) -> dict[str, int]:
        return {
            "data": self._data(),
            "pipeline": self.pipeline,
            "context": self.context,
            "tensor": self.tensor,
        }

    def group_ranks(self, dim: str) -> list[list[int]]:
        """All groups along ``dim`` (one of :data:`DIMS`), each a list of ranks."""
        if dim not in DIMS:
            raise ValueError(f"unknown dimension {dim!r}; valid: {list(DIMS)}")
        axis = DIMS.index(dim)
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            coords = self.coords(rank)
            groups.setdefault(coords[:axis] + coords[axis + 1 :], []).append(rank)
        return list(groups.values())

    def replica_ranks(self) -> list[list[int]]:
        """The data × context groups (ranks with equal weights), each ordered by
        ``data · context + context index``."""
        groups: dict[tuple[int, int], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            groups.setdefault((c.pipeline, c.tensor), []).append(rank)
        return list(groups.values())

    def pipeline_ranks(self, coords: Coords) -> list[int]:
        """The ranks of the pipeline that ``coords`` belongs to, stage by stage."""
        return [
            self.rank_of(coords.data, s, coords.context, coords.tensor)
            for s in range(self.pipeline)
        ]


# ---------------------------------------------------------------------- the one check
def layout_problems(
    dims: ParallelDims,
    world_size: int | None = None,
    model: nn.Module | None = None,
    global_batch: int | None = None,
) -> list[str]:
    """Why ``dims`` cannot run, one phrase per problem (empty when it can); see
    :func:`check_layout`."""
    sizes = {
        "data": dims.data, "pipeline": dims.pipeline, "context": dims.context,
        "tensor": dims.tensor, "microbatches": dims.microbatches,
        "virtual_stages": dims.virtual_stages, "expert": dims.expert,
    }  # fmt: skip
    bad = [
        f"{name}={value!r} must be a positive integer"
        for name, value in sizes.items()
        if not (value is None and name == "data") and not _positive(value)
    ]
    if bad:
        return bad
    problems: list[str] = []
    if dims.context > 1 and dims.pipeline > 1:
        problems.append(
            f"context={dims.context} with pipeline={dims.pipeline}: a pipeline stage never sees "
            "the position ids each context rank's chunk needs; use pipeline=1 with context > 1"
        )
    if dims.sequence_parallel and dims.tensor == 1:
        problems.append("sequence_parallel=true needs tensor > 1")
    try:
        validate_schedule_args(
            dims.schedule,
            dims.pipeline,
            dims.microbatches,
            dims.virtual_stages,
            allow_split_backward=True,
        )
    except ValueError as err:
        problems.append(str(err))
    data = dims.data
    if world_size is not None:
        problem, data = _world_problem(dims, world_size)
        problems += [problem] if problem else []
    if dims.expert > 1 and data and (data * dims.context) % dims.expert:
        problems.append(
            f"expert={dims.expert} does not divide data ({data}) × context ({dims.context}) = "
            f"{data * dims.context}: the experts are split over data × context ranks (the world "
            "size stays data × pipeline × context × tensor); use an expert degree that divides it"
        )
    if model is not None:
        problems += _model_problems(dims, model)
    if global_batch is not None and data:
        split = data * dims.microbatches
        if global_batch % split:
            parts = f"data ({data})" + (
                f" × microbatches ({dims.microbatches}) = {split}" if dims.microbatches > 1 else ""
            )
            problems.append(
                f"global batch {global_batch} is not divisible by {parts}; use a multiple of "
                f"{split} as the data module's batch_size"
            )
    return problems


def check_layout(
    dims: ParallelDims,
    *,
    world_size: int | None = None,
    model: nn.Module | None = None,
    global_batch: int | None = None,
) -> None:
    """Raise a :class:`LayoutError` listing every reason ``dims`` cannot run.

    What is checked depends on what is given: the sizes and options alone always; the world
    (``world_size``: trainer devices × nodes, or the process group's size); the model (through
    its contracts: the tensor degree must divide ``tensor_parallel_divisors()``, every virtual
    stage needs one of ``pipeline_layers()``; cheap on a model built on the ``meta`` device);
    and the global batch, which must split into data × microbatches equal parts. A model that
    lacks a contract the layout needs raises ``TypeError`` naming the missing method.
    """
    problems = layout_problems(dims, world_size, model, global_batch)
    if problems:
        raise LayoutError("this layout cannot run: " + "; ".join(problems))


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _product(dims: ParallelDims, with_data: bool) -> str:
    """``data (2) × pipeline (2) × tensor (2)``: context only where it is used."""
    names = ("data", "pipeline", "context", "tensor") if with_data else DIMS[1:]
    return " × ".join(
        f"{n} ({getattr(dims, n)})" for n in names if n != "context" or dims.context > 1
    )


def _world_problem(dims: ParallelDims, world: int) -> tuple[str | None, int | None]:
    """The world-size problem, if any, and the data degree the world gives."""
    mp = dims.model_parallel
    fits = world >= mp and world % mp == 0
    if dims.data is None:
        if fits:
            return None, world // mp
        return (
            f"world size {world} is not divisible by {_product(dims, False)} = {mp}; use a "
            f"multiple of {mp} ranks (trainer devices × nodes) or other degrees"
        ), None
    if dims.data * mp == world:
        return None, dims.data
    hint = f"set data={world // mp} or change" if fits else "change"
    return (
        f"{_product(dims, True)} = {dims.data * mp}, but the world size is {world}; {hint} "
        "the devices / nodes"
    ), dims.data


def _model_problems(dims: ParallelDims, model: nn.Module) -> list[str]:
    problems = []
    if dims.tensor > 1:
        shardable = require(model, TensorParallelShardable, "tensor parallelism")
        problems += [
            f"model.{p}"
            for p in tensor_parallel_problems(shardable.tensor_parallel_divisors(), dims.tensor)
        ]
    if dims.pipeline > 1:
        layers = len(require(model, PipelineSplittable, "pipeline parallelism").pipeline_layers())
        stages = dims.pipeline * dims.virtual_stages
        if layers < stages:
            problems.append(
                f"the model has {layers} pipeline layers, fewer than pipeline ({dims.pipeline}) × "
                f"virtual stages ({dims.virtual_stages}) = {stages}; every stage needs at least one"
            )
    return problems


# ---------------------------------------------------------------------- process groups
@dataclass
class ProcessGroups:
    """This rank's process groups along each dimension (built collectively by every rank)."""

    dims: ParallelDims
    rank: int
    data: dist.ProcessGroup | None = field(default=None, repr=False)
    pipeline: dist.ProcessGroup | None = field(default=None, repr=False)
    context: dist.ProcessGroup | None = field(default=None, repr=False)
    tensor: dist.ProcessGroup | None = field(default=None, repr=False)
    data_ranks: list[int] = field(default_factory=list)
    pipeline_ranks: list[int] = field(default_factory=list)
    context_ranks: list[int] = field(default_factory=list)
    tensor_ranks: list[int] = field(default_factory=list)
    replica: dist.ProcessGroup | None = field(default=None, repr=False)  # data × context
    replica_ranks: list[int] = field(default_factory=list)
    expert: dist.ProcessGroup | None = field(default=None, repr=False)  # tokens exchanged
    expert_ranks: list[int] = field(default_factory=list)
    expert_copies: dist.ProcessGroup | None = field(default=None, repr=False)  # same experts
    expert_copy_ranks: list[int] = field(default_factory=list)

    @property
    def coords(self) -> Coords:
        return self.dims.coords(self.rank)


def build_process_groups(dims: ParallelDims, backend: str | None = None) -> ProcessGroups:
    """Create every group of every dimension (``new_group`` is collective) and keep this rank's.

    Call on all ranks after ``dist.init_process_group``; raises the :class:`LayoutError` of
    :func:`check_layout` when the layout does not fit the world.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_process_groups needs torch.distributed to be initialised first")
    dims = dims.resolve(dist.get_world_size())
    mine = ProcessGroups(dims=dims, rank=dist.get_rank())
    for dim in DIMS:
        for ranks in dims.group_ranks(dim):
            group = dist.new_group(ranks, backend=backend)
            if mine.rank in ranks:
                if dim == "data":
                    mine.data, mine.data_ranks = group, ranks
                elif dim == "pipeline":
                    mine.pipeline, mine.pipeline_ranks = group, ranks
                elif dim == "context":
                    mine.context, mine.context_ranks = group, ranks
                else:
                    mine.tensor, mine.tensor_ranks = group, ranks
    mine.replica, mine.replica_ranks = mine.data, mine.data_ranks
    if dims.context > 1:  # the flattened data × context groups gradients are averaged over
        for ranks in dims.replica_ranks():
            group = dist.new_group(ranks, backend=backend)
            if mine.rank in ranks:
                mine.replica, mine.replica_ranks = group, ranks
    if dims.expert > 1:  # the expert groups (all-to-all) and the copies of the same experts
        for ranks in dims.expert_ranks():
            group = dist.new_group(ranks, backend=backend)
            if mine.rank in ranks:
                mine.expert, mine.expert_ranks = group, ranks
        for ranks in dims.expert_copy_ranks():
            group = dist.new_group(ranks, backend=backend)
            if mine.rank in ranks:
                mine.expert_copies, mine.expert_copy_ranks = group, ranks
    return mine
