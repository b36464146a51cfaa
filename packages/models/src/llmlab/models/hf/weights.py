"""Where each llmlab parameter lives in an HF checkpoint, and how to read a slice of it.

A :class:`Source` names the HF tensor behind one llmlab tensor and the two layout differences
that occur: GPT-2's ``Conv1D`` stores ``(in, out)`` where ``nn.Linear`` stores ``(out, in)``
(``transpose``), and GPT-2's fused ``c_attn`` orders its outputs ``[q heads | k heads | v
heads]`` where llmlab's ``qkv`` goes head by head ``[q_h, k_h, v_h]`` so that a contiguous
column shard holds whole heads (``qkv_heads``). The Llama family needs neither: its tensors
are llmlab's under other names. Mixtures of experts add two: llmlab stacks the experts' weights
``(E, out, in)`` where checkpoints store each expert as its own tensors (``experts``: the
per-expert names, stacked along a new first dimension), and ``transformers``' own stacked
layout fuses gate and up as ``gate_up_proj`` ``(E, 2I, C)`` (``half``: llmlab's ``gate_proj``
is the first half of dimension 1, ``up_proj`` the second).

:func:`read_tensor` reads a :class:`Shard` -- part ``index`` of ``count`` equal parts along one
dimension of the *llmlab* tensor -- by asking the file for exactly the HF elements that make it
(for a fused qkv shard: three column ranges, one per q/k/v), so a tensor-parallel rank never
reads another rank's bytes. :func:`read_state_dict` does that for a set of names: a pipeline
stage passes only its layers' names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import Tensor

from llmlab.models.hf.folder import CheckpointError, CheckpointFolder


@dataclass(frozen=True)
class Source:
    """The HF tensor behind one llmlab tensor."""

    hf_name: str
    transpose: bool = False  # GPT-2 Conv1D: HF (in, out) is llmlab's (out, in)
    qkv_heads: tuple[int, int] | None = None  # (heads, head_dim): [q|k|v] -> per-head [q,k,v]
    experts: tuple[str, ...] = ()  # per-expert tensors stacked as dim 0 (hf_name: the first)
    half: int | None = None  # 0 / 1: the first / second half of dim 1 (a fused gate_up_proj)

    @property
    def hf_names(self) -> tuple[str, ...]:
        """Every HF tensor this llmlab tensor is made of."""
        return self.experts or (self.hf_name,)


@dataclass(frozen=True)
class Shard:
    """Part ``index`` of ``count`` equal parts of a tensor along dimension ``dim``."""

    dim: int
    index: int
    count: int

    def bounds(self, size: int, name: str) -> tuple[int, int]:
        if not 0 <= self.index < self.count or size % self.count:
            raise ValueError(
                f"{name}: cannot take part {self.index} of {self.count} along dim {self.dim} "
                f"of size {size} (it must divide evenly)"
            )
        step = size // self.count
        return self.index * step, (self.index + 1) * step


def llmlab_shape(folder: CheckpointFolder, source: Source) -> tuple[int, ...]:
    shape = folder.shape(source.hf_name)
    if source.experts:
        return (len(source.experts), *shape)
    if source.half is not None:
        return (shape[0], shape[1] // 2, *shape[2:])
    return tuple(reversed(shape)) if source.transpose else shape


def read_tensor(folder: CheckpointFolder, source: Source, shard: Shard | None = None) -> Tensor:
    """The llmlab tensor ``source`` describes, or its ``shard``, reading only those bytes."""
    shape = llmlab_shape(folder, source)
    ndim = len(shape)
    # The llmlab-side index: full slices, except along the shard's dimension.
    want = [slice(None)] * ndim
    if shard is not None:
        if not 0 <= shard.dim < ndim:
            raise ValueError(f"{source.hf_name}: shard dim {shard.dim} of a {ndim}-d tensor")
        want[shard.dim] = slice(*shard.bounds(shape[shard.dim], source.hf_name))
    if source.qkv_heads is not None:
        return _read_qkv(folder, source, want)
    if source.experts:
        return _read_experts(folder, source, shard)
    if source.half is not None:  # the gate or up half of a fused (E, 2I, C) gate_up_proj
        offset = source.half * shape[1]
        rows = want[1]
        start, stop = rows.start or 0, shape[1] if rows.stop is None else rows.stop
        want[1] = slice(offset + start, offset + stop)
        return folder.read(source.hf_name, tuple(want))
    hf_index = tuple(reversed(want)) if source.transpose else tuple(want)
    tensor = folder.read(source.hf_name, hf_index if shard is not None else ())
    return tensor.t().contiguous() if source.transpose else tensor


def _read_experts(folder: CheckpointFolder, source: Source, shard: Shard | None) -> Tensor:
    """Per-expert tensors stacked: a shard along dimension 0 reads only its experts' tensors
    (what an expert-parallel rank needs); along another dimension, that slice of each."""
    names = source.experts
    inner = None
    if shard is not None and shard.dim == 0:
        lo, hi = shard.bounds(len(names), source.hf_name)
        names = names[lo:hi]
    elif shard is not None:
        inner = Shard(shard.dim - 1, shard.index, shard.count)
    return torch.stack([read_tensor(folder, Source(n), inner) for n in names])


def _read_qkv(folder: CheckpointFolder, source: Source, want: list[slice]) -> Tensor:
    """GPT-2's fused qkv: llmlab rows ``[h·3D + p·D + d]`` are HF outputs ``[p·C + h·D + d]``."""
    heads, D = source.qkv_heads
    C = heads * D
    rows = want[0]
    start, stop = rows.start or 0, rows.stop if rows.stop is not None else 3 * C
    if start % (3 * D) or stop % (3 * D):
        raise ValueError(
            f"{source.hf_name}: a qkv shard must hold whole heads (rows in multiples of "
            f"{3 * D}), got rows [{start}, {stop})"
        )
    h0, h1 = start // (3 * D), stop // (3 * D)
    parts = []
    for p in range(3):  # q, k, v: the same heads' columns of each third
        cols = slice(p * C + h0 * D, p * C + h1 * D)
        if len(want) == 1:  # the bias
            parts.append(folder.read(source.hf_name, (cols,)))
        else:  # HF (in, out): llmlab's column slice is HF's row slice
            parts.append(folder.read(source.hf_name, (want[1], cols)).t())
    n = h1 - h0
    stacked = torch.stack(parts)  # (3, n·D, ...)
    rest = stacked.shape[2:]
    return stacked.reshape(3, n, D, *rest).transpose(0, 1).reshape(3 * n * D, *rest).contiguous()


def to_hf_tensors(source: Source, tensor: Tensor) -> dict[str, Tensor]:
    """The HF tensors (name -> tensor) that a whole llmlab tensor is written as."""
    if source.half is not None:
        raise ValueError(
            f"{source.hf_name}: writing transformers' fused gate_up_proj is not supported; "
            "llmlab writes each expert's tensors, as transformers' save_pretrained does"
        )
    if source.experts:
        return {n: tensor[e].contiguous() for e, n in enumerate(source.experts)}
    return {source.hf_name: to_hf_layout(source, tensor)}


def to_hf_layout(source: Source, tensor: Tensor) -> Tensor:
    """The inverse of :func:`read_tensor` on a whole tensor: llmlab's layout -> the HF file's."""
    if source.qkv_heads is not None:
        heads, D = source.qkv_heads
        rest = tensor.shape[1:]
        tensor = tensor.reshape(heads, 3, D, *rest).transpose(0, 1).reshape(3 * heads * D, *rest)
    return tensor.t().contiguous() if source.transpose else tensor.contiguous()


def read_state_dict(
    folder: CheckpointFolder,
    sources: Mapping[str, Source],
    names: Iterable[str] | None = None,
    shards: Mapping[str, Shard] | None = None,
) -> dict[str, Tensor]:
    """llmlab tensors ``names`` (default: all of ``sources``), each whole or its ``shards[name]``;
    only the requested bytes are read (see :attr:`CheckpointFolder.bytes_read`)."""
    shards = shards or {}
    chosen = list(sources) if names is None else list(names)
    unknown = [n for n in chosen if n not in sources]
    if unknown:
        raise KeyError(f"no checkpoint source for llmlab tensor(s) {unknown[:3]}")
    return {n: read_tensor(folder, sources[n], shards.get(n)) for n in chosen}


# A tensor-parallel plan style -> which dimension of a module's weight and bias is split.
PLAN_DIMS: dict[str, dict[str, int]] = {
    "colwise": {"weight": 0, "bias": 0},  # output features
    "rowwise": {"weight": 1},  # input features; the bias is added once, after the reduction
    "vocab": {"weight": 0},  # vocabulary rows (embedding table or LM head)
}


def tensor_parallel_shards(
    plan: Mapping[str, str], names: Iterable[str], rank: int, world: int
) -> dict[str, Shard]:
    """The :class:`Shard` of each parameter ``names`` that a model's
    ``tensor_parallel_plan()`` splits, for tensor-parallel rank ``rank`` of ``world``; the
    parameters it leaves whole (norms, a row-parallel bias) are absent."""
    shards: dict[str, Shard] = {}
    for name in names:
        module, _, kind = name.rpartition(".")
        for pattern, style in plan.items():
            if fnmatchcase(module, pattern):
                if style not in PLAN_DIMS and style != "replicate":
                    raise ValueError(f"unknown tensor-parallel style {style!r} for {pattern!r}")
                dim = PLAN_DIMS.get(style, {}).get(kind)
                if dim is not None:
                    shards[name] = Shard(dim, rank, world)
                break
    return shards


def check_coverage(folder: CheckpointFolder, sources: Mapping[str, Source], ignored: Any) -> None:
    """Every tensor of the checkpoint is read by some llmlab tensor (or is known to be inert):
    a tensor nobody reads would be a part of the model silently dropped.

    The message names the weights file: the one holding a tensor nobody reads, or, for a
    missing tensor, the file (or shard index) that should have listed it. A missing tensor
    next to an unread one is reported together -- the usual cause is a renamed key."""
    used = {n for s in sources.values() for n in s.hf_names}
    missing = sorted(n for n in used if n not in folder.tensors)
    extra = sorted(n for n in folder.tensors if n not in used and not ignored(n))
    if missing:
        where, unread = _weights_file(folder), ""
        if extra:
            holder = _file_of(folder, extra[0])
            unread = (
                f"; {'it' if holder == where else holder} holds {extra[0]!r} instead, which no "
                "part of the model reads (a renamed key?)"
            )
        raise CheckpointError(
            f"{where}: lacks tensor {missing[0]!r} that config.json implies "
            f"({len(missing)} missing in all){unread}"
        )
    if extra:
        raise CheckpointError(
            f"{_file_of(folder, extra[0])}: holds tensor {extra[0]!r} ({len(extra)} unused in "
            "all) that no part of the llmlab model reads: refusing to drop it (config.json and "
            "weights disagree)"
        )


def _weights_file(folder: Any) -> Any:
    """Where a folder lists its tensors: the shard index, or the one safetensors file."""
    weight_map = getattr(folder, "weight_map", None)
    if not weight_map:  # an in-memory state dict: its description
        return folder.path
    files = set(weight_map.values())
    return folder.path / (next(iter(files)) if len(files) == 1 else "model.safetensors.index.json")


def _file_of(folder: Any, name: str) -> Any:
    weight_map = getattr(folder, "weight_map", None)
    return folder.path / weight_map[name] if weight_map and name in weight_map else folder.path
