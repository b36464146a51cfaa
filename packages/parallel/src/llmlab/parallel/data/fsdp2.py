"""FSDP2 (``torch.distributed.fsdp.fully_shard``) as the data dimension's sharding, beside
llmlab's own :class:`~llmlab.parallel.data.zero.ZeroEngine` (``strategy.zero_impl=fsdp2``).

``fully_shard`` turns every parameter into a ``DTensor`` sharded on dim 0 over a data mesh,
all-gathers a unit's parameters before its forward (and, when it resharded after forward,
again before its backward) and reduce-scatters its gradients after its backward. That is
llmlab's ZeRO with other bookkeeping, so the two map stage for stage where they can:

    zero=3  ->  reshard_after_forward=True    parameters, gradients, optimizer state sharded
    zero=2  ->  reshard_after_forward=False   ... full parameters kept from forward to backward
    zero=0, 1   refused: FSDP2 always reduce-scatters the gradients (stage 0 is DDP, stage 1
                keeps them whole); use ``zero_impl=llmlab``

Per step both move the same bytes: each unit's padded parameters all-gathered once per forward
(and once more per backward at stage 3) and its gradients reduce-scattered once, ``(p-1)/p`` of
each on the wire. ``comm/dp_bytes`` counts the collectives FSDP2 actually launches
(:class:`CollectiveBytes`), so the two implementations are compared by measurement.

Tensor parallelism: llmlab's Megatron layers hold *plain* tensors, the tensor rank's slice of
each weight. ``fully_shard`` over the replica dimension (data × context) of a replicas × tensor
``DeviceMesh`` (built from the layout's own process groups) shards those slices across the
replicas of one tensor coordinate -- exactly the ranks ZeRO shards over -- while the tensor
collectives keep running on the tensor group. The ``DTensor`` parameters carry the slice's shard
dim, so the whole-model norm and the checkpoints place them as before. A replicated parameter
whose gradient on each tensor rank is a part of a sum (sequence parallelism's norms; one inside
an attention module, such as a q/k norm) had that sum done by a gradient hook on the parameter,
which ``fully_shard`` replaces: :meth:`FSDP2Engine.sum_partial_gradients` all-reduces their
gradient shards over the tensor group instead, once the reduce-scatter is done (the two sums
commute).

Expert parallelism: each MoE layer's experts module (its expert slices) is a unit of its own,
sharded over the ranks that hold the same experts (:func:`expert_mesh`, torchtitan's
``dp_mod_ep``) rather than over data × context; FSDP2 averages its gradients over that mesh, and
:meth:`FSDP2Engine.finish_gradients` divides them by ``replicas / copies`` more (a sum over the
copies divided by every replica, :mod:`llmlab.parallel.expert`; gloo has no pre-multiplied
reduce-scatter for ``set_gradient_divide_factor``). The layer calls its experts module (its
``forward`` is the grouped path), so FSDP2 gathers the slices around the call.

Not expressible here (refused up front by :func:`fsdp2_refusal`): a pipeline (FSDP2's backward
hooks reduce once per backward, the schedule runs several), fp32 master weights of an fp16/bf16
model (``MixedPrecisionPolicy`` keeps fp32 *parameters* instead: another recipe), fp8 layers,
``compile`` and activation checkpointing (not verified against one process here).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode

from llmlab.parallel.data.zero_memory import model_state_stats, optimizer_state_bytes
from llmlab.parallel.expert import EXPERT_ATTR
from llmlab.parallel.mesh import ProcessGroups
from llmlab.parallel.precision.plugins import WholeModelMixedPrecision, WholeModelPrecision
from llmlab.parallel.tensor import primitives as C
from llmlab.parallel.tensor.layers import (
    REGION_PARTIAL_ATTR,
    SEQUENCE_PARALLEL_ATTR,
    SHARD_DIM_ATTR,
)
from llmlab.parallel.transforms import ModelTransforms

IMPLS = ("llmlab", "fsdp2")
RESHARD_AFTER_FORWARD = {2: False, 3: True}  # llmlab ZeRO stage -> fully_shard's setting
FSDP2_PRECISIONS = ("32-true", "32", "bf16-mixed")
_PLAIN_PLUGINS = (Precision, MixedPrecision, WholeModelPrecision, WholeModelMixedPrecision)


def fsdp2_refusal(
    zero: int,
    pipeline: int = 1,
    *,
    plugin: type | None = None,
    precision: str | None = None,
    transforms: ModelTransforms | None = None,
) -> str | None:
    """Why ``zero_impl=fsdp2`` cannot run this config (``None``: it can), naming the values.

    ``plugin``: the precision plugin's class (``None``: Lightning's, from ``precision``).
    """
    if zero not in RESHARD_AFTER_FORWARD:
        return (
            f"strategy.zero_impl=fsdp2 expresses ZeRO stages 2 (reshard_after_forward=False) and "
            f"3 (reshard_after_forward=True), got strategy.zero={zero}: FSDP2 always "
            "reduce-scatters gradients; use zero_impl=llmlab for zero=0 or zero=1"
        )
    if pipeline > 1:
        return (
            f"strategy.zero_impl=fsdp2 with strategy.pipeline={pipeline} is refused: FSDP2 "
            "reduce-scatters at the end of every backward pass and a pipeline schedule runs "
            "one per micro-batch; use zero_impl=llmlab with zero=1"
        )
    if plugin is not None and plugin not in _PLAIN_PLUGINS:
        return (
            f"strategy.zero_impl=fsdp2 runs with Lightning's 32-true or bf16-mixed precision, "
            f"not the plugin {plugin.__name__} (fp32 master weights and fp8 layers live in "
            "llmlab's ZeRO engine); use zero_impl=llmlab"
        )
    if precision is not None and str(precision) not in FSDP2_PRECISIONS:
        return (
            f"strategy.zero_impl=fsdp2 runs with precision {' or '.join(FSDP2_PRECISIONS)}, got "
            f"{precision!r}; use zero_impl=llmlab"
        )
    if transforms is not None and transforms.compile:
        return "strategy.zero_impl=fsdp2 with compile=true is not verified here; set compile=false"
    if transforms is not None and transforms.activation_checkpointing is not None:
        return (
            "strategy.zero_impl=fsdp2 with activation_checkpointing is not verified here; "
            "use zero_impl=llmlab, or recompute_attention"
        )
    return None


def data_mesh(groups: ProcessGroups, device_type: str) -> DeviceMesh:
    """The replica dimension (data × context: torchtitan's ``dp_shard_cp``) of a replicas ×
    tensor ``DeviceMesh`` made of the layout's own groups (no new process group): FSDP2 shards
    over it, tensor parallelism talks over the other. Context ranks hold other tokens of the same
    sequences, so their gradients are averaged with the data replicas' (the ranks are laid out
    ``(data · context + context index) · tensor + tensor index`` without a pipeline)."""
    dims = groups.dims
    ranks = torch.arange(dims.world_size).view(dims.replicas, dims.tensor)
    mesh = DeviceMesh.from_group(
        [groups.replica, groups.tensor], device_type, mesh=ranks,
        mesh_dim_names=("replica", "tensor"),
    )  # fmt: skip
    return mesh["replica"]


# the data collectives FSDP2 launches -> which argument is the payload counted
_PAYLOAD_ARG = {
    "c10d::_allgather_base_": 0,  # (output, input, group, ...): the gathered output
    "c10d::_reduce_scatter_base_": 1,  # (output, input, group, ...): the full input
    "c10d::allreduce_": 0,  # ([tensors], group, ...)
}


class CollectiveBytes(TorchDispatchMode):
    """Counts the payload of the data-parallel collectives launched while active, the way
    llmlab's engine counts its own: an all-gather by its output, a reduce-scatter by its input,
    an all-reduce by its buffer. Only the ops on ``group`` count (tensor parallelism's go to
    ``comm/tp_*``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        which = _PAYLOAD_ARG.get(func.name())
        if which is not None and any(self._is_ours(a) for a in args):
            payload = args[which]
            tensors = payload if isinstance(payload, list | tuple) else [payload]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))

    def _is_ours(self, arg: Any) -> bool:
        """The dispatcher hands the group over boxed (a ``ScriptObject``)."""
        if type(arg).__name__ != "ScriptObject":
            return False
        try:
            return dist.ProcessGroup.unbox(arg) is self.group
        except RuntimeError:  # another boxed object (a ReduceOp)
            return False


class FSDP2Engine:
    """``fully_shard`` of ``module`` (its repeated blocks first, then the rest) over ``mesh``.

    It answers what the N-D strategy and the checkpoint module ask of
    :class:`~llmlab.parallel.data.zero.ZeroEngine` (``named_params``, ``pieces``,
    ``optimizer_param``, ``no_sync``, ``take_comm_bytes``, ``memory_stats``...); the optimizer
    steps the ``DTensor`` parameters themselves, so ``rewire`` only measures it.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        mesh: DeviceMesh,
        blocks: Sequence[nn.Module] | None = None,
        tensor_group: dist.ProcessGroup | None = None,
        expert_mesh: DeviceMesh | None = None,
        replicas: int = 1,
    ) -> None:
        problem = fsdp2_refusal(stage)
        if problem:
            raise ValueError(problem)
        self.module = module
        self.stage = stage
        self.mesh = mesh
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.rank = mesh.get_local_rank()
        if blocks is None:
            get = getattr(module, "repeated_blocks", None)
            blocks = list(get()) if callable(get) else []
        kept_attrs = {
            n: {a: getattr(p, a) for a in (SHARD_DIM_ATTR, EXPERT_ATTR) if hasattr(p, a)}
            for n, p in module.named_parameters()
        }
        partial = {n for n, p in module.named_parameters() if _partial(p)}
        reshard = RESHARD_AFTER_FORWARD[stage]
        self.units: list[FSDPModule] = []
        experts = _expert_modules(module)
        if experts and expert_mesh is None:
            raise ValueError("FSDP2 of a model with expert slices needs the expert_mesh")
        for m in experts:  # first: the blocks then leave these weights to them
            self.units.append(fully_shard(m, mesh=expert_mesh, reshard_after_forward=reshard))
        # FSDP2 averages a unit's gradients over its mesh; expert slices are summed over their
        # copies and divided by every replica (llmlab.parallel.expert): replicas / copies more
        self._experts = [p for m in experts for p in m.parameters(recurse=False)]
        self._expert_divide = replicas / expert_mesh.size() if experts else 1.0
        self.units += [fully_shard(b, mesh=mesh, reshard_after_forward=reshard) for b in blocks]
        self.units.append(fully_shard(module, mesh=mesh, reshard_after_forward=reshard))
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        in_blocks = [{id(p) for p in b.parameters()} for b in blocks]
        root = {id(p) for _, p in self._named} - set().union(*in_blocks)
        size = {id(p): p.numel() * p.element_size() for _, p in self._named}
        self._unit_bytes = [sum(size.get(i, 0) for i in ids) for ids in [*in_blocks, root]]
        for name, p in self._named:  # the tensor-parallel dim, the expert slice survive the swap
            for attr, value in kept_attrs.get(name, {}).items():
                setattr(p, attr, value)
        self.tensor_group = tensor_group
        self._partial = [p for n, p in self._named if n in partial]
        self.counter = CollectiveBytes(self.group)
        self.optimizers: list[Optimizer] = []
        self._peak = 0

    @classmethod
    def for_held(
        cls,
        model: nn.Module,
        stage: int,
        mesh: DeviceMesh,
        held: Sequence[nn.Parameter],
        tensor_group: dist.ProcessGroup | None = None,
        expert_mesh: DeviceMesh | None = None,
        replicas: int = 1,
    ) -> FSDP2Engine:
        """FSDP2 for a (tensor-parallel) model whose every parameter this rank holds; its
        units are the modules holding expert slices (sharded over ``expert_mesh``: the ranks
        holding the same experts, torchtitan's ``dp_mod_ep``; gradients divided by the
        ``replicas``), then the repeated blocks. ``held`` must be all of them (no pipeline)."""
        ids = {id(p) for p in held}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in ids]
        if missing:
            raise ValueError(f"FSDP2 shards whole modules; this rank lacks {missing[:4]}")
        return cls(
            model,
            stage,
            mesh,
            tensor_group=tensor_group,
            expert_mesh=expert_mesh,
            replicas=replicas,
        )

    # ================================================================ the optimizer
    def rewire(self, optimizer: Optimizer) -> None:
        """The optimizer already steps the sharded ``DTensor`` parameters (built after
        ``fully_shard``); keep it, to measure its state."""
        if optimizer not in self.optimizers:
            self.optimizers.append(optimizer)

    def group_members(self, optimizer: Optimizer) -> list[list[nn.Parameter]]:
        return [list(g["params"]) for g in optimizer.param_groups]

    def refresh_params(self) -> None:
        """Every unit back to its shards (the values a load or a step wrote are the shards)."""
        for unit in self.units:
            unit.reshard()

    # ================================================================ gradients
    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: full gradients accumulate, nothing is reduce-scattered. At
        stage 2 the full parameters also stay until the boundary micro-batch (as llmlab's
        ZeRO-2 keeps them), instead of FSDP2's default of resharding after every backward and
        gathering again for the next micro-batch's forward: one all-gather per step, not one
        per micro-batch."""
        root = self.units[-1]
        root.set_requires_gradient_sync(False)
        keep = self.stage == 2
        if keep:
            root.set_reshard_after_backward(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)
            if keep:
                root.set_reshard_after_backward(True)

    def finish_gradients(self) -> None:
        """Once per optimizer step, after the backward's reduce-scatters: the partial sums over
        the tensor group (:meth:`sum_partial_gradients`), and the expert slices' gradients
        divided by ``replicas / copies`` (gloo has no pre-multiplied reduce-scatter for
        ``set_gradient_divide_factor``)."""
        self.sum_partial_gradients()
        grads = [p.grad.to_local() for p in self._experts if p.grad is not None]
        if grads and self._expert_divide != 1.0:
            torch._foreach_div_(grads, self._expert_divide)

    def sum_partial_gradients(self) -> None:
        """All-reduce over the tensor group the gradient shards of the replicated parameters
        whose gradient is a part of a sum on each tensor rank (module docstring); once per
        optimizer step, after the backward's reduce-scatter."""
        grads = [p.grad.to_local() for p in self._partial if p.grad is not None]
        if grads and self.tensor_group is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            total = C.all_reduce(flat, self.tensor_group, "fsdp2.partial_grad")
            for g, part in zip(grads, total.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))

    @contextmanager
    def counting(self) -> Generator[None, None, None]:
        """Count the data collectives launched inside (the strategy wraps each step in it)."""
        with self.counter:
            yield

    # ================================================================ inspection
    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, sharded DTensor parameter)``, named as in the unsharded model."""
        return list(self._named)

    def pieces(self) -> Iterator[tuple[str, nn.Parameter, int, int, Tensor]]:
        """``(name, parameter, lo, hi, values)``: this rank's dim-0 rows of each parameter as a
        flat range of the (tensor-parallel) local tensor -- what ZeRO's pieces are, so the
        sharded checkpoint writes and reads both alike."""
        for name, p in self._named:
            local = p.to_local()
            if local.numel() == 0:
                continue  # fewer rows than data ranks: none live here
            mesh = p.device_mesh  # the data mesh, or an expert slice's copies
            rows = _rows_per_rank(p, mesh.size())
            lo = mesh.get_local_rank() * rows * (p.numel() // max(1, p.shape[0]))
            yield name, p, lo, lo + local.numel(), local.view(-1)

    def optimizer_param(self, param: nn.Parameter) -> nn.Parameter | None:
        return param if param.to_local().numel() > 0 else None

    def model_param_of(self) -> dict[int, nn.Parameter]:
        return {}  # the optimizer steps the model's own (sharded) parameters

    def optimizer_grads(self) -> list[Tensor]:
        return [p.grad.to_local() for _, p in self._named if p.grad is not None]

    # ================================================================ accounting
    def take_comm_bytes(self) -> int:
        sent, self.counter.bytes = self.counter.bytes, 0
        return sent

    def memory_stats(self) -> dict[str, float]:
        """``memory/*_bytes`` as :class:`~llmlab.parallel.data.zero_memory.ZeroMemory` reports
        them: params kept between a unit's forward and backward (full at stage 2, shards at 3),
        gradient shards, optimizer state; the peak adds the largest unit gathered (stage 3) or
        every unit (stage 2) and one unit's full gradients being reduce-scattered."""
        shard = sum(p.to_local().nbytes for _, p in self._named)
        full_total = sum(p.numel() * p.element_size() for _, p in self._named)
        grads = sum(p.grad.to_local().nbytes for _, p in self._named if p.grad is not None)
        optim = optimizer_state_bytes(self.optimizers)
        params = full_total if self.stage == 2 else shard
        largest = max(self._unit_bytes, default=0)
        gathered = full_total if self.stage == 2 else 2 * largest  # current + prefetched
        self._peak = max(self._peak, shard + grads + optim + gathered + largest)
        return model_state_stats(params, grads, optim, self._peak)

    def close(self) -> None:
        """Leave every unit sharded (the shards are what a checkpoint after fit reads)."""
        self.refresh_params()


def _expert_modules(module: nn.Module) -> list[nn.Module]:
    """The modules whose own parameters are expert slices (each MoE layer's experts)."""
    return [
        m
        for m in module.modules()
        if any(hasattr(p, EXPERT_ATTR) for p in m.parameters(recurse=False))
    ]


def expert_mesh(groups: ProcessGroups, device_type: str) -> DeviceMesh | None:
    """The ranks holding the same experts as this one (``None`` without expert parallelism):
    the mesh FSDP2 shards expert slices over."""
    if groups.dims.expert == 1:
        return None
    return DeviceMesh.from_group(groups.expert_copies, device_type)


def _partial(p: Tensor) -> bool:
    """A replicated parameter whose gradient tensor parallelism sums over its group."""
    return getattr(p, SEQUENCE_PARALLEL_ATTR, False) or getattr(p, REGION_PARTIAL_ATTR, False)


def _rows_per_rank(p: Tensor, world: int) -> int:
    """``torch.chunk``'s row count, FSDP2's dim-0 split: ``ceil(rows / world)``."""
    return -(-p.shape[0] // world) if p.dim() > 0 else 1


def local_rows(value: Tensor, like: DTensor) -> Tensor:
    """This rank's dim-0 chunk of ``value`` (``like``'s full shape), as ``like`` holds it."""
    mesh = like.device_mesh
    chunks = value.chunk(mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    local = chunks[rank] if rank < len(chunks) else value[:0]
    return local.reshape(like.to_local().shape)


def as_dtensor_like(local: Tensor, like: DTensor) -> DTensor:
    """``local`` (this rank's rows) as a ``DTensor`` placed like ``like``."""
    return DTensor.from_local(
        local.reshape(like.to_local().shape), like.device_mesh, like.placements,
        shape=like.shape, stride=like.stride(),
    )  # fmt: skip


def full_named(values: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Full tensors of DTensor values (a collective over their mesh), plain ones as they are."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in values.items()}
