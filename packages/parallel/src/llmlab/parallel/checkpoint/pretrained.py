"""Pretrained weights into any layout: a model built on ``meta`` is filled after its layout is
applied, each rank reading only what it keeps.

``model.init_from=<folder>`` builds the model on the ``meta`` device (shapes, no memory) and
hands a :class:`~llmlab.parallel.contracts.WeightSource` over. ``parallelize_model`` shards the
meta model (tensor parallelism), cuts it to this rank's pipeline stage and then calls
:func:`load_pretrained`: every tensor the stage's modules use is read from the source -- whole,
or, where tensor parallelism split it (the ``tp_shard_dim`` it leaves on the shard), exactly
``chunk(tensor, dim)[tensor_rank]``, the slice ``parallelize`` would have cut from a full weight;
an expert-parallel rank's expert stacks (the ``ep_slice`` they carry) read only its experts
(``chunk(tensor, 0)[index]``; per-expert files: only those experts' tensors). So a rank reads
``sharded bytes of its stage / tensor + replicated bytes of its stage`` (norms, row-parallel
biases), never another stage's layers nor another rank's slice or experts. Under ZeRO
the data-parallel replicas each read that same slice and the engine keeps 1/data of it (the
flat ZeRO shard is not a rectangle of the files, so it is not read on its own).

A LoRA layer's base (:class:`~llmlab.parallel.contracts.LowRankAdapted`) is read under the
layer's own name (``q_proj.base_layer.weight`` from the files' ``q_proj.weight``); its adapters
are no meta tensors (drawn from the run's seed, not read), so they are left as they are.

Filling keeps every Parameter *object* (``torch.utils.swap_tensors``): the tied-weight groups,
gradient hooks and optimizers already built around the meta model keep working.

Memory is measured, not estimated: the bytes read and kept, and the process's peak resident
set (``ru_maxrss``) and its growth while loading; on CUDA, the allocator's peak.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmlab.parallel.contracts import HoldsPretrainedWeights, LowRankAdapted, WeightSource
from llmlab.parallel.expert import EXPERT_ATTR
from llmlab.parallel.tensor.layers import SHARD_DIM_ATTR

log = logging.getLogger(__name__)
MiB = 1024**2


@dataclass(frozen=True)
class WeightsRead:
    """What one rank read from a :class:`WeightSource`, and what that cost it."""

    tensors: int  # distinct tensors filled (a tied weight once)
    bytes_read: int  # from the files: this rank's slices
    bytes_kept: int  # in the model after filling (its dtype)
    share_bytes: int  # the same tensors whole in the files: what a whole read would cost
    peak_rss_bytes: int  # the process's resident-set high-water mark after filling
    rss_growth_bytes: int  # how much filling raised that high-water mark
    cuda_peak_bytes: int  # torch.cuda.max_memory_allocated (0 without CUDA)
    seconds: float

    def line(self) -> str:
        return (
            f"read {self.bytes_read / MiB:.2f} MiB of its stage's {self.share_bytes / MiB:.2f} "
            f"MiB ({self.tensors} tensors, {self.seconds:.2f} s), keeps "
            f"{self.bytes_kept / MiB:.2f} MiB; peak RSS {self.peak_rss_bytes / MiB:.0f} MiB "
            f"(+{self.rss_growth_bytes / MiB:.1f} MiB while loading)"
            + (f", CUDA peak {self.cuda_peak_bytes / MiB:.1f} MiB" if self.cuda_peak_bytes else "")
        )


def take_pretrained_weights(module: Any) -> WeightSource | None:
    """The module's pending weights (:class:`HoldsPretrainedWeights`), now this caller's to read."""
    return module.take_pretrained_weights() if isinstance(module, HoldsPretrainedWeights) else None


def load_pretrained(
    model: nn.Module,
    weights: WeightSource,
    held: Sequence[nn.Module] | None = None,
    tensor_rank: int = 0,
    tensor_size: int = 1,
) -> WeightsRead:
    """Fill every ``meta`` tensor that the modules ``held`` use (default: all of ``model``) from
    ``weights``, by the unsplit model's state-dict name, reading only this rank's
    tensor-parallel slice of the sharded ones (module docstring). Raises ``ValueError`` naming a
    tensor whose piece has another shape, or a held tensor nothing filled."""
    keep = {id(t) for m in (held or [model]) for t in [*m.parameters(), *m.buffers()]}
    rss_before, start, read_before = _peak_rss(), time.perf_counter(), weights.bytes_read
    names: list[str] = []
    kept = 0
    bases = {id(t) for m in model.modules() if isinstance(m, LowRankAdapted)
             for t in m.base_layer.state_dict(keep_vars=True).values()}  # fmt: skip
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in keep or not tensor.is_meta:
            continue  # another stage's placeholder, or filled under another (tied) name
        dim = getattr(tensor, SHARD_DIM_ATTR, None)
        part = (dim, tensor_rank, tensor_size) if dim is not None and tensor_size > 1 else None
        experts = getattr(tensor, EXPERT_ATTR, None)  # (index, count): replicated over tensor
        if experts is not None:
            part = (0, *experts)
        if id(tensor) in bases:  # ``<layer>.base_layer.<tensor>`` is ``<layer>.<tensor>``
            head, _, tail = name.rpartition(".base_layer.")
            name = f"{head}.{tail}"
        value = weights.read(name, part)
        if tuple(value.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{name}: the checkpoint gives shape {list(value.shape)} for part {part} but this "
                f"rank's model holds {list(tensor.shape)}"
            )
        fill(tensor, value.to(tensor.dtype).contiguous())  # a column slice is strided
        names.append(name)
        kept += tensor.numel() * tensor.element_size()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.is_meta and id(t) in keep]  # fmt: skip
    if left:
        raise ValueError(f"the pretrained weights left {left[:3]} unfilled ({len(left)} in all)")
    return WeightsRead(
        tensors=len(names),
        bytes_read=weights.bytes_read - read_before,
        bytes_kept=kept,
        share_bytes=weights.total_bytes(names),
        peak_rss_bytes=_peak_rss(),
        rss_growth_bytes=_peak_rss() - rss_before,
        cuda_peak_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
        seconds=time.perf_counter() - start,
    )


def fill(placeholder: Tensor, value: Tensor) -> None:
    """Give the ``meta`` tensor object ``placeholder`` the storage of ``value``, keeping the
    object, its attributes (``tp_shard_dim``...) and its gradient hooks (sequence parallelism
    registers some), which ``swap_tensors`` would leave behind with the meta storage."""
    hooks = dict(getattr(placeholder, "_backward_hooks", None) or {})
    if isinstance(placeholder, nn.Parameter):
        value = nn.Parameter(value, requires_grad=placeholder.requires_grad)
    value.__dict__.update(placeholder.__dict__)
    torch.utils.swap_tensors(placeholder, value)
    if hooks:
        placeholder._backward_hooks = None  # the swapped dict is no longer wired to autograd
        for hook in hooks.values():
            placeholder.register_hook(hook)


def log_weights_read(report: WeightsRead, where: str) -> list[dict[str, Any]]:
    """Every rank's report, logged by rank 0 one line per rank (a collective when distributed:
    the other ranks' log lines are silenced); returns them all, by global rank."""
    mine = {"where": where, **asdict(report)}
    reports = [mine]
    if dist.is_initialized():
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, mine)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for rank, r in enumerate(reports):
            line = WeightsRead(**{k: v for k, v in r.items() if k != "where"}).line()
            log.info("init_from: rank %d %s %s", rank, r["where"], line)
    return reports


def _peak_rss() -> int:
    """The process's peak resident set in bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
