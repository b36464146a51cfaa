"""Expert parallelism: each rank of an expert group keeps ``E / ep`` of a mixture-of-experts
layer's experts, and the rows routed to the others travel there and back by all-to-all.

Megatron-Core's all-to-all token dispatcher and torchtitan's expert-parallel style are the
examples. The MoE layer keeps its router, its sort by expert, its capacity drop, the weighting
and the combine; what it hands over (the ``ExpertParallelizable`` contract,
:mod:`llmlab.parallel.contracts`) is its expert computation ``fn(x, counts) -> y`` over the rows
``x`` sorted by expert, ``counts[e]`` rows for expert ``e``. :func:`dispatch` wraps it:

1. counts: one all-to-all of the ``E`` counts (equal splits of ``E / ep``): rank ``r`` learns
   how many rows each source rank sends to each of its local experts, ``recv[s, e]``;
2. dispatch: the rows for expert ``e`` live on rank ``e // (E / ep)``, and ``x`` is sorted by
   expert, so the rows for each rank are one contiguous slice: one ``all_to_all_single`` with
   split sizes (uneven; an expert with no rows sends nothing). They arrive grouped by source
   rank, then by local expert;
3. regroup by local expert (a stable sort: each expert's rows stay in source-rank order) and run
   the layer's own ``fn`` over the local experts' weights (the grouped path);
4. combine: undo the regrouping and send each row back with the reverse all-to-all.

Both all-to-alls are one small autograd Function (:class:`_AllToAll`): forward sends with
``(out_splits, in_splits)``, backward sends the gradient back with the splits swapped. Every row
is computed by the same expert weights as in one process, in the same order when the expert
group's ranks hold consecutive parts of the batch (the data sampler's split), so the result
equals the unsplit layer's.

With the other dimensions. The expert groups are drawn per (pipeline stage, tensor rank): a
stage's MoE layers exchange rows with the same stage of the other replicas, which run the same
schedule, so their all-to-alls meet in the same order, micro-batch by micro-batch. The routed
experts and the router are replicated over the tensor group (the models' tensor-parallel plans
leave them out, Megatron-Core's ``expert_tensor_parallel_size=1``): without sequence parallelism
every tensor rank dispatches the same rows (exact, the work repeated); with it each tensor rank
routes its own sequence shard, and the experts' gradients are summed over the tensor group like a
norm weight's. Expert parallelism is applied before tensor parallelism, so that the sequence-
parallel gradient hooks land on the slices.

Gradients. Expert ``e``'s weights on a rank receive the gradient of every row routed to ``e``
from the whole expert group (the backward all-to-all brings it). The ranks with the same expert
index in the other expert groups hold a copy of the same experts (``data × context / ep`` of
them): their gradients are *summed* over those copies and divided by ``data × context`` -- the
number of ranks that hold different tokens, whose losses are each scaled for an average over
all of them (:mod:`llmlab.parallel.loss_mean`) -- while every other weight is averaged over all
``data × context`` ranks as before. The whole-model gradient norm counts each expert slice once
(summed over the expert group) and each replicated weight once (``1/ep`` per expert-group rank).

What crosses the wire per MoE layer and step (``comm/ep_bytes``, per rank, payload bytes): with
``S`` of this rank's kept assignments routed to experts on other ranks, ``R`` rows received from
other ranks, ``C``-wide rows of ``b``-byte elements, ``E`` experts split over ``ep`` ranks:
``2 · (S + R) · C · b`` (dispatch and combine forward, and their gradients backward) plus
``8 · E · (ep - 1) / ep`` for the counts. Under activation checkpointing a recomputed layer's
forward runs again in backward, on every rank of the group in the same order: its forward part
twice, ``3 · (S + R) · C · b`` and the counts twice.

Compile, activation checkpointing and every precision compose with it (checked against one
process); :data:`EXPERT_REFUSALS` lists what does not yet.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmlab.parallel.contracts import ExpertFn, ExpertParallelizable

EXPERT_ATTR = "ep_slice"  # (index, count): the parameter holds experts slice ``index`` of ``count``

EXPERT_REFUSALS = {  # what expert > 1 does not compose with yet, and why
    "precision": "with ZeRO, a master-weight plugin's fp32 masters and loss scale are the "
    "ZeRO engine's shards, which expert slices are not (their gradients would stay scaled); use "
    "bf16-mixed or fp32 with ZeRO, or a master-weight precision without ZeRO",
}


def expert_refusal(what: str, value: Any, expert: int) -> str:
    """The message refusing ``what=value`` with ``strategy.expert=expert``."""
    return (
        f"strategy.expert={expert} with {what}={value} is refused: {EXPERT_REFUSALS[what]}; "
        "use strategy.expert=1 or leave the option out"
    )


# ------------------------------------------------------------------------ the collective
@dataclass
class DispatchStats:
    """Bytes this rank sent to other ranks of its expert group (rows, their gradients and the
    counts) since the last :meth:`take`."""

    bytes_sent: int = 0

    def take(self) -> int:
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent


def _all_to_all(
    x: Tensor, out_splits: list[int], in_splits: list[int], group: Any, rank: int,
    stats: DispatchStats | None,
) -> Tensor:  # fmt: skip
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    if stats is not None:  # rows to the other ranks (its own stay here)
        row = math.prod(x.shape[1:]) * x.element_size()
        stats.bytes_sent += (sum(in_splits) - in_splits[rank]) * row
    return out


class _AllToAll(torch.autograd.Function):
    """Rows ``in_splits[r]`` to rank ``r``, ``out_splits[r]`` from it; backward: the reverse."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any,
        rank: int, stats: DispatchStats | None,
    ) -> Tensor:  # fmt: skip
        ctx.splits, ctx.args = (out_splits, in_splits), (group, rank, stats)
        return _all_to_all(x, out_splits, in_splits, group, rank, stats)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        return (_all_to_all(grad, in_splits, out_splits, *ctx.args), *([None] * 5))


def dispatch(
    x: Tensor,
    counts: Tensor,
    fn: ExpertFn,
    group: Any,
    size: int,
    rank: int,
    stats: DispatchStats | None = None,
) -> Tensor:
    """``fn`` over the experts of the whole expert group (``size`` ranks, this one ``rank``):
    ``x`` (M, C) rows sorted by expert, ``counts`` (E,) rows per expert; returns ``y`` (M, C')
    for the same rows, each computed on the rank that holds its expert (module docstring)."""
    E = counts.numel()
    local = E // size
    send = counts.to(torch.int64).contiguous()
    recv = _all_to_all(send, [local] * size, [local] * size, group, rank, stats)
    recv = recv.view(size, local)  # rows from source s for local expert e
    in_splits = send.view(size, local).sum(1).tolist()
    out_splits = recv.sum(1).tolist()
    rows = _AllToAll.apply(x, out_splits, in_splits, group, rank, stats)  # by source, expert
    expert_of_row = torch.arange(local, device=x.device).repeat(size)
    expert_of_row = expert_of_row.repeat_interleave(recv.flatten().to(x.device))
    order = torch.argsort(expert_of_row, stable=True)
    y = fn(rows[order], recv.sum(0).to(counts.device))
    if rows.requires_grad and not y.requires_grad:  # no row here: the backward all-to-alls
        y = y + rows.sum() * 0  # must still run on this rank, or the others wait forever
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return _AllToAll.apply(y[inverse], in_splits, out_splits, group, rank, stats)


# ------------------------------------------------------------------------ the transform
@dataclass
class ExpertParallel:
    """Expert parallelism of a model over ``group`` (``size`` ranks; this one ``index``):
    :meth:`apply` keeps this rank's slice of every MoE layer's experts and wraps the layers'
    expert computation in :func:`dispatch`. ``params``: the expert slices this rank holds."""

    group: Any
    size: int
    index: int
    params: list[nn.Parameter] = field(default_factory=list)
    stats: DispatchStats = field(default_factory=DispatchStats)

    def apply(self, model: nn.Module) -> int:
        """Shard and wrap every ``ExpertParallelizable`` layer of ``model``; the number of layers
        changed (an error when none: expert > 1 asked of a model without experts)."""
        layers = check_has_experts(model, self.size)
        changed = 0
        for layer in layers:
            self._shard(layer)
            changed += layer.swap_experts(self._wrap)
        return changed

    @contextmanager
    def uncounted(self) -> Generator[None, None, None]:
        """All-to-alls inside (validation, test) are not counted in :attr:`stats`."""
        sent = self.stats.bytes_sent
        try:
            yield
        finally:
            self.stats.bytes_sent = sent

    def _shard(self, layer: Any) -> None:
        for name, p in layer.expert_parameters().items():
            E = p.shape[0]
            if E % self.size:
                raise ValueError(
                    f"{name}: {E} experts cannot be split over expert={self.size} ranks; "
                    "use an expert degree that divides the number of experts"
                )
            per = E // self.size
            owner_name, _, leaf = name.rpartition(".")
            owner = layer.get_submodule(owner_name) if owner_name else layer
            kept = nn.Parameter(
                p.detach()[self.index * per : (self.index + 1) * per].clone(),
                requires_grad=p.requires_grad,
            )
            setattr(kept, EXPERT_ATTR, (self.index, self.size))
            setattr(owner, leaf, kept)
            self.params.append(kept)

    def _wrap(self, fn: ExpertFn) -> ExpertFn:
        def expert_parallel(x: Tensor, counts: Tensor) -> Tensor:
            return dispatch(x, counts, fn, self.group, self.size, self.index, self.stats)

        return expert_parallel


def check_has_experts(model: nn.Module, expert: int) -> list[Any]:
    """The model's ``ExpertParallelizable`` layers; ``ValueError`` when there is none (an
    expert degree that would change nothing). Cheap on a ``meta`` model."""
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelizable)]
    if not layers:
        raise ValueError(
            f"strategy.expert={expert} found no mixture-of-experts layer in "
            f"{type(model).__name__} (no module with expert_parameters() and swap_experts(), "
            "the ExpertParallelizable contract in llmlab.parallel.contracts); use expert=1"
        )
    return layers


def is_expert_slice(p: Tensor) -> bool:
    return hasattr(p, EXPERT_ATTR)


def split_expert_params(
    params: list[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the replicated parameters, the expert slices) of ``params``, each in order."""
    return [p for p in params if not is_expert_slice(p)], [p for p in params if is_expert_slice(p)]
