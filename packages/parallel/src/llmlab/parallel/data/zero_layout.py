"""Where ZeRO puts every parameter: units, their flat buffers, and this rank's shard of each.

A *unit* is what ZeRO-3 gathers at once: one of the model's ``repeated_blocks()`` (contract in
:mod:`llmlab.parallel.contracts`), plus one unit for every parameter outside them (embeddings,
final norm, head). Each unit's parameters are laid end to end in one :class:`FlatBuffer`, padded
to a multiple of the data-parallel degree ``n``, and rank ``r`` owns the ``r``-th of its ``n``
equal contiguous ranges. The same layout serves every stage, so one collective per unit moves its
gradients (reduce-scatter) or its parameters (all-gather), and padding is at most ``n - 1``
elements per unit.

A rank's range cuts through parameters, so the optimizer cannot step the model's parameters
themselves. Each parameter overlapping the range gets a *piece*: a 1-D ``nn.Parameter`` viewing
its elements ``lo:hi`` inside the rank's master shard. Rewiring the optimizer's param groups from
parameters to their pieces keeps every per-group setting (weight decay or not, the LR schedule)
while the optimizer only ever allocates state for the shard -- FSDP's ``use_orig_params`` idea.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmlab.parallel.buffers import FlatBuffer

REST = "rest"  # the name of the unit that holds the parameters outside every block

# torch 2.13 renamed the tensor collectives; older versions only have the first names.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Piece:
    """Elements ``lo:hi`` of ``param`` (flattened) held by this rank as ``master``, which sits at
    ``at`` in the unit's shard (and its gradient at ``at`` in the gradient shard)."""

    name: str
    param: nn.Parameter
    lo: int
    hi: int
    at: int
    master: nn.Parameter  # what the optimizer steps: a view of the unit's master shard


@dataclass
class Unit:
    """One gather/reduce unit: its parameters, their flat buffer, and this rank's shard."""

    index: int
    name: str
    params: list[nn.Parameter]
    names: list[str]
    full: FlatBuffer  # compute dtype; the parameters' ``.data`` are its views
    start: int  # this rank's range [start, end) of ``full``
    end: int
    shard: Tensor  # compute-dtype shard: the all-gather input (own storage at stage 3)
    master: Tensor  # master-dtype shard (the same tensor as ``shard`` when the dtypes agree)
    pieces: list[Piece] = field(default_factory=list)
    grads: FlatBuffer | None = None  # stages 0-1: persistent full gradients (``.grad`` views)
    grad_shard: Tensor | None = None  # stages 1-3: this rank's averaged gradient shard
    # step-time state
    ready: int = 0
    reduced: bool = False
    pending: tuple | None = None  # an in-flight reduction: (work, tensors kept alive)
    gather_work: dist.Work | None = None

    @property
    def gathered(self) -> bool:
        return self.full.allocated

    @property
    def shard_numel(self) -> int:
        return self.end - self.start


def partition(
    named_params: Sequence[tuple[str, nn.Parameter]], blocks: Sequence[nn.Module]
) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """Group parameters into units: one per block (in the order given), then the rest.

    Each parameter goes to the first unit that holds it; blocks without parameters of their own
    (all frozen, or all claimed already) make no unit. The rest unit comes last, or not at all.
    """
    owner: dict[int, int] = {}
    for b, block in enumerate(blocks):
        for p in block.parameters():
            owner.setdefault(id(p), b)
    by_unit: dict[int, list[tuple[str, nn.Parameter]]] = {}
    rest: list[tuple[str, nn.Parameter]] = []
    for name, p in named_params:
        if id(p) in owner:
            by_unit.setdefault(owner[id(p)], []).append((name, p))
        else:
            rest.append((name, p))
    units = [(f"block{b}", by_unit[b]) for b in sorted(by_unit)]
    if rest:
        units.append((REST, rest))
    return units


def build_unit(
    index: int,
    name: str,
    named: list[tuple[str, nn.Parameter]],
    *,
    stage: int,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None,
    master_dtype: torch.dtype,
    initial: Mapping[int, Tensor],
) -> Unit:
    """Lay out one unit: pack its parameters (rank 0's values for everyone, as DDP does), point
    the parameters at the flat buffer, cut this rank's shard and make its pieces."""
    names = [n for n, _ in named]
    params = [p for _, p in named]
    dtypes = {p.dtype for p in params}
    devices = {p.device for p in params}
    if len(dtypes) > 1 or len(devices) > 1:
        raise ValueError(
            f"ZeRO unit {name!r} mixes dtypes {sorted(map(str, dtypes))} / devices "
            f"{sorted(map(str, devices))}; one unit is one flat buffer, so cast the model to one "
            "dtype and device before wrapping it"
        )
    dtype = params[0].dtype
    master_dtype = torch.promote_types(master_dtype, dtype)  # never below the model: fp64 stays
    full = FlatBuffer([p.detach() for p in params], pad_to=world)
    start, end = full.bounds(rank, world)
    # Exact starting values: the higher-precision ones a precision plugin kept, else the
    # parameters. Rank 0's values win, so every replica starts equal.
    exact = [initial.get(id(p), p.detach()) for p in params]
    separate_master = stage >= 1 and master_dtype != dtype
    src = dist.get_global_rank(group, 0)
    if separate_master:
        staging = FlatBuffer(params, pad_to=world, dtype=master_dtype)
        staging.pack(exact)
        if world > 1:
            dist.broadcast(staging.data, src=src, group=group)
        full.data.copy_(staging.data)
        master = staging.shard(rank, world).clone()
        del staging
    else:
        full.pack(exact)
        if world > 1:
            dist.broadcast(full.data, src=src, group=group)
        master = None
    with torch.no_grad():
        for p, view in zip(params, full.views):
            p.data = view
    if stage >= 3:
        shard = full.shard(rank, world).clone()  # the only persistent copy of the parameters
        full.free()
    else:
        shard = full.shard(rank, world)  # a view: the optimizer's in-place step lands in place
    if master is None:
        master = shard
    unit = Unit(index, name, params, names, full, start, end, shard, master)
    if stage >= 1:
        for i, lo, hi in full.segments(start, end):
            at = full.offsets[i] + lo - start
            piece = nn.Parameter(master[at : at + hi - lo], requires_grad=True)
            unit.pieces.append(Piece(names[i], params[i], lo, hi, at, piece))
        unit.grad_shard = torch.zeros(end - start, dtype=master_dtype, device=master.device)
    if stage <= 1:
        unit.grads = FlatBuffer([p.detach() for p in params], pad_to=world)
        for p, view in zip(params, unit.grads.views):
            p.grad = view
    return unit


def stage3_segments(
    module: nn.Module, blocks: Sequence[nn.Module], rest_ids: set[int]
) -> list[nn.Module]:
    """The modules whose forward uses the rest unit: the largest subtrees holding no block.

    A module that runs blocks *and* owns rest parameters directly would need them across all its
    blocks, which ZeRO-3's two-unit bound cannot grant: refused, naming it.
    """
    block_ids = {id(b) for b in blocks}
    holds_block: dict[int, bool] = {}

    def contains_block(m: nn.Module) -> bool:
        if id(m) not in holds_block:
            holds_block[id(m)] = id(m) in block_ids or any(contains_block(c) for c in m.children())
        return holds_block[id(m)]

    out: list[nn.Module] = []

    def visit(m: nn.Module, path: str) -> None:
        if id(m) in block_ids:
            return
        if not contains_block(m):
            if any(id(p) in rest_ids for p in m.parameters()):
                out.append(m)
            return
        own = [n for n, p in m.named_parameters(recurse=False) if id(p) in rest_ids]
        if own:
            raise ValueError(
                f"ZeRO-3: module {path or '<root>'} ({type(m).__name__}) owns parameters {own} "
                "and also runs repeated blocks, so they would have to stay gathered across every "
                "block; move them into a submodule of their own (as GPT's Embedding and Head)"
            )
        for child_name, c in m.named_children():
            visit(c, f"{path}.{child_name}" if path else child_name)

    visit(module, "")
    return out


def check_stage3_sharing(units: Sequence[Unit], users: Mapping[int, Sequence[nn.Module]]) -> None:
    """ZeRO-3 frees a unit while other units run: a parameter used from two units' modules
    (weights tied across a block boundary) would be read while freed. Refused, naming it."""
    for unit in units:
        for name, p in zip(unit.names, unit.params):
            holders = [i for i, mods in users.items() if any(_owns(m, p) for m in mods)]
            if len(holders) > 1:
                raise ValueError(
                    f"ZeRO-3: parameter {name} is used by modules of {len(holders)} units "
                    f"({[units[i].name for i in holders]}); a unit's parameters are freed while "
                    "the others run. Keep tied parameters in one unit (outside the blocks)"
                )


def _owns(module: nn.Module, p: nn.Parameter) -> bool:
    return any(q is p for q in module.parameters())
