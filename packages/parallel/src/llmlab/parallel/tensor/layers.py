"""Megatron-style sharded layers, each built by slicing a full ``nn.Linear`` / ``nn.Embedding``.

Building from the full layer (rather than initialising shards) means a tp=1 model and a tp=N model
start from identical parameters, and checkpoints consolidate by concatenation.

* ``ColumnParallelLinear``: ``Y = X Wᵀ`` with ``W`` split by output rows,
  ``W = [W_0; ...; W_{n-1}]``: rank ``i`` computes ``Y_i = X W_iᵀ``, a slice of the output's
  last dimension. Its input enters through ``f`` (copy; all-reduce the gradient) or, under
  sequence parallelism, an all-gather of the sequence shards.
* ``RowParallelLinear``: ``W`` split by input columns, ``W = [W_0, ..., W_{n-1}]``; the input is
  already split the same way, so ``Y = Σ_i X_i W_iᵀ``: one all-reduce (``g``) or, under sequence
  parallelism, a reduce-scatter along the sequence. The bias is added once, after the sum.
* ``VocabParallelEmbedding``: rows ``[start, end)`` of the table per rank; ids outside the range
  look up zeros, and the sum over ranks (all-reduce or reduce-scatter) is the full lookup.

Both Linear layers do their local product through ``local_linear(x, weight, bias)``
(``F.linear``), the one seam a precision recipe overrides: fp8
(:mod:`llmlab.parallel.precision.fp8`) quantises the local shard there and leaves the
collectives around it untouched.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from llmlab.parallel.tensor import primitives as C
from llmlab.parallel.tensor.mappings import (
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
)
from llmlab.parallel.tensor.primitives import Group

# Attributes set on sharded parameters so checkpoints can be consolidated without the plan:
# ``tp_shard_dim`` (the dimension that was split) and ``tp_full_size`` (its unsharded length).
SHARD_DIM_ATTR = "tp_shard_dim"
# Replicated parameters whose gradient is partial (they see only a sequence shard).
SEQUENCE_PARALLEL_ATTR = "tp_sequence_parallel"
# Replicated parameters inside a tensor-parallel region, whose gradient is partial without
# sequence parallelism too: they feed only this rank's heads (a q/k norm, latent attention's
# down-projections).
REGION_PARTIAL_ATTR = "tp_region_partial"


def shard_parameter(full: Tensor, dim: int, group: Group, what: str) -> nn.Parameter:
    """This rank's contiguous slice of ``full`` along ``dim``, as a fresh Parameter."""
    n, rank = C.group_size(group), C.group_rank(group)
    C.check_divisible(full.shape[dim], n, what)
    piece = full.detach().chunk(n, dim=dim)[rank].clone().contiguous()
    param = nn.Parameter(piece, requires_grad=full.requires_grad)
    setattr(param, SHARD_DIM_ATTR, dim)
    param.tp_full_size = full.shape[dim]
    return param


def _replicated(full: Tensor | None) -> nn.Parameter | None:
    if full is None:
        return None
    return nn.Parameter(full.detach().clone(), requires_grad=full.requires_grad)


class ColumnParallelLinear(nn.Linear):
    """A Linear whose output features are split across the tensor-parallel group.

    Subclasses ``nn.Linear`` (without its initialisation) so that code which treats Linear
    weights specially, such as weight-decay parameter groups, treats the shard alike.
    """

    def __init__(
        self,
        full: nn.Linear,
        group: Group,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        weight: nn.Parameter | None = None,
        name: str = "ColumnParallelLinear",
        input_in_region: bool = False,
    ) -> None:
        """``input_in_region``: the input already entered the tensor-parallel region upstream,
        once for a whole module (an attention module, whose code reads the sequence length from
        its input and may compute replicated pieces from it): all-gathered under sequence
        parallelism, else copied with its gradient all-reduced. The layer takes it as is."""
        nn.Module.__init__(self)
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True is incompatible with sequence_parallel=True")
        self.group = group
        self.in_features = full.in_features
        self.out_features = full.out_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.input_in_region = input_in_region
        what = f"{name}: out_features"
        self.weight = weight if weight is not None else shard_parameter(full.weight, 0, group, what)
        self.bias = None if full.bias is None else shard_parameter(full.bias, 0, group, what)

    def local_linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """This rank's ``x Wᵀ (+ b)`` on its shard, between the collectives."""
        return F.linear(x, weight, bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.input_in_region:
            pass  # entered upstream; that entry's backward sums the partial gradients
        elif self.sequence_parallel:
            x = gather_from_sequence_region(x, self.group)
        else:
            x = copy_to_tensor_region(x, self.group)
        y = self.local_linear(x, self.weight, self.bias)
        return gather_from_tensor_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.weight.shape[0]}), gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Linear):
    """A Linear whose input features are split; its input comes already split (``X_i``).

    Subclasses ``nn.Linear`` (without its initialisation), as ``ColumnParallelLinear`` does.
    """

    def __init__(
        self,
        full: nn.Linear,
        group: Group,
        sequence_parallel: bool = False,
        name: str = "RowParallelLinear",
    ) -> None:
        nn.Module.__init__(self)
        self.group = group
        self.in_features = full.in_features
        self.out_features = full.out_features
        self.sequence_parallel = sequence_parallel
        self.weight = shard_parameter(full.weight, 1, group, f"{name}: in_features")
        self.bias = _replicated(full.bias)
        if self.bias is not None and sequence_parallel:
            setattr(self.bias, SEQUENCE_PARALLEL_ATTR, True)

    def local_linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """This rank's partial product ``X_i W_iᵀ``, before the sum over ranks."""
        return F.linear(x, weight, bias)

    def forward(self, x: Tensor) -> Tensor:
        partial = self.local_linear(x, self.weight, None)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(partial, self.group)
        else:
            y = reduce_from_tensor_region(partial, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), "
            f"out_features={self.out_features}, sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """An Embedding whose rows (the vocabulary) are split across the tensor-parallel group."""

    def __init__(
        self,
        full: nn.Embedding,
        group: Group,
        sequence_parallel: bool = False,
        weight: nn.Parameter | None = None,
        name: str = "VocabParallelEmbedding",
    ) -> None:
        super().__init__()
        if full.padding_idx is not None or full.max_norm is not None:
            raise ValueError(f"{name}: padding_idx / max_norm are not supported by the vocab shard")
        self.group = group
        self.num_embeddings = full.num_embeddings
        self.embedding_dim = full.embedding_dim
        self.sequence_parallel = sequence_parallel
        what = f"{name}: vocabulary size (num_embeddings)"
        self.weight = weight if weight is not None else shard_parameter(full.weight, 0, group, what)
        per_rank = self.num_embeddings // C.group_size(group)
        self.vocab_start = C.group_rank(group) * per_rank
        self.vocab_end = self.vocab_start + per_rank

    def forward(self, ids: Tensor) -> Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(partial, self.group)
        return reduce_from_tensor_region(partial, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, "
            f"{self.vocab_end}), sequence_parallel={self.sequence_parallel}"
        )


def local_vocab_range(vocab_size: int, group: Group) -> tuple[int, int]:
    n, rank = C.group_size(group), C.group_rank(group)
    C.check_divisible(vocab_size, n, "vocabulary size")
    per_rank = vocab_size // n
    return rank * per_rank, (rank + 1) * per_rank
