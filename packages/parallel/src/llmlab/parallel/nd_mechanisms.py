"""What the N-D strategy connects once its model is laid out and its optimizer built: the
gradient reducer, the memory report, the checkpoint door and the whole-model norm.

Each is built from the layout (``dims``, ``groups``), what ``parallelize_model`` made
(``parallel``), the data-sharding engine (ZeRO or FSDP2, or none) and the precision plugin's fp32
masters. Kept out of :mod:`llmlab.parallel.strategy` so the strategy reads as Lightning's hooks
and this module as the one place that decides which group reduces, gathers or norms what.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmlab.parallel.checkpoint.checkpointer import LayoutCheckpointer
from llmlab.parallel.data.fsdp2 import FSDP2Engine
from llmlab.parallel.data.zero_memory import ReplicatedMemory
from llmlab.parallel.expert import split_expert_params
from llmlab.parallel.norm import WholeModelNorm
from llmlab.parallel.pipeline.grad_sync import GradientReducer
from llmlab.parallel.precision.plugins import MasterWeightPrecision


@dataclass
class StepMechanisms:
    reducer: GradientReducer
    memory: Any  # ReplicatedMemory, or the ZeRO / FSDP2 engine: what memory/* reports
    checkpointer: LayoutCheckpointer
    norm: WholeModelNorm


def build_step_mechanisms(strategy: Any) -> StepMechanisms:
    """The mechanisms of ``strategy`` (an ``NDParallelStrategy`` after its setup): gradients
    averaged over data × context (none with ZeRO, which reduce-scatters itself), expert
    gradients over the ranks holding the same experts; the checkpoint gathering tensor shards
    over the tensor group and expert slices over the expert group; the norm over every group
    that holds different pieces."""
    groups, dims, zero, parallel = (
        strategy.groups,
        strategy.dims,
        strategy.zero_engine,
        strategy.parallel,
    )
    assert parallel is not None
    data = (groups.replica, dims.replicas) if zero is None else (None, 1)
    # expert slices reduced and normed apart from the rest, except under FSDP2: it shards and
    # reduce-scatters them over their copies itself, like every other weight
    experts = [] if isinstance(zero, FSDP2Engine) else split_expert_params(parallel.params)[1]
    reducer = GradientReducer(
        parallel.params,
        parallel.tied,
        *data,
        experts=experts,
        expert_group=groups.expert_copies,
        replicas=dims.replicas,
    )
    plugin = strategy.precision_plugin
    masters = plugin.masters if isinstance(plugin, MasterWeightPrecision) else None
    held = masters.masters if zero is None and masters is not None else ()  # zero=0's fp32
    memory = ReplicatedMemory(parallel.params, strategy.optimizers, held) if zero is None else zero
    layout = {
        **dims.sizes(),
        "zero": strategy.zero,
        "zero_impl": strategy.zero_impl,
        "sequence_parallel": dims.sequence_parallel,
    }
    checkpointer = LayoutCheckpointer(
        strategy.lightning_module,
        strategy.model_attribute,
        groups,
        parallel.duplicates,
        zero,
        masters,
        strategy.sharded_checkpoints,
        layout=layout,
    )
    norm_groups = (groups.tensor, groups.pipeline, *((groups.replica,) if zero else ()))
    # the optimizer's tensors (masters, ZeRO pieces) stand for the model parameters the
    # checkpointer names them by
    norm = WholeModelNorm(
        dims.tensor,
        (*norm_groups, groups.expert),
        parallel.duplicates,
        checkpointer.model_param_of,
        experts,
        dims.expert,
        # under ZeRO the sum runs over every replica too: each expert slice is held by
        # data × context / expert of them, and that sum is summed again over the expert group
        expert_weight=1.0 / dims.replicas if zero is not None else 1.0,
    )
    return StepMechanisms(reducer, memory, checkpointer, norm)
