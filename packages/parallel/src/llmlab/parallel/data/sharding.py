"""The data dimension's sharding engine, by ``strategy.zero_impl``: llmlab's hand-written
:class:`~llmlab.parallel.data.zero.ZeroEngine` or torch's FSDP2
(:class:`~llmlab.parallel.data.fsdp2.FSDP2Engine`). The N-D strategy builds either here and
drives both through the same small interface (``rewire``, ``no_sync``, ``model_param_of``,
``take_comm_bytes``, ``memory_stats``, the checkpoint module's ``pieces``...)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn

from llmlab.parallel.data.fsdp2 import (
    IMPLS,
    FSDP2Engine,
    data_mesh,
    expert_mesh,
    fsdp2_refusal,
)
from llmlab.parallel.data.zero import ZeroEngine
from llmlab.parallel.expert import split_expert_params
from llmlab.parallel.mesh import ProcessGroups
from llmlab.parallel.transforms import ModelTransforms


def check_zero_impl(
    impl: str,
    zero: int,
    pipeline: int,
    transforms: ModelTransforms | None = None,
    plugin: type | None = None,
    precision: str | None = None,
) -> None:
    """Refuse an unknown ``zero_impl``, or a config FSDP2 cannot run, before any work
    (``plugin``, ``precision``: the run's, when known)."""
    if impl not in IMPLS:
        raise ValueError(f"strategy.zero_impl must be one of {IMPLS}, got {impl!r}")
    if impl != "fsdp2":
        return
    problem = fsdp2_refusal(
        zero, pipeline, plugin=plugin, precision=precision, transforms=transforms
    )
    if problem:
        raise ValueError(problem)


def build_data_sharding(
    impl: str,
    model: nn.Module,
    stage: int,
    groups: ProcessGroups,
    held: Sequence[nn.Parameter],
    plugin: Precision,
    device_type: str,
    initial: Mapping[int, Tensor] | None = None,
    reduce_in_backward: bool = True,
) -> ZeroEngine | FSDP2Engine:
    """The engine for ``held`` (this rank's parameters of ``model``, named as in the unsplit
    model) over the data (× context) group of ``groups``; FSDP2 first checks the precision
    plugin. Expert slices (expert parallelism) stay out of llmlab's engine: replicated over
    the ranks that hold the same experts, not the data group, they are reduced over those
    (``GradientReducer.reduce_experts``) and stepped whole; FSDP2 shards them over those
    ranks instead (its own reduce-scatter)."""
    if impl == "llmlab":
        replicated, experts = split_expert_params(list(held))
        return ZeroEngine.for_held(
            model,
            stage,
            groups.replica,
            replicated,
            initial=initial,
            reduce_in_backward=reduce_in_backward,
            kept=experts,
        )
    problem = fsdp2_refusal(
        stage,
        groups.dims.pipeline,
        plugin=type(plugin),
        precision=getattr(plugin, "precision", None),
    )
    if problem:
        raise ValueError(problem)
    mesh = data_mesh(groups, device_type)
    return FSDP2Engine.for_held(
        model, stage, mesh, held, tensor_group=groups.tensor,
        expert_mesh=expert_mesh(groups, device_type), replicas=groups.dims.replicas,
    )  # fmt: skip
