"""Megatron-style tensor parallelism (with sequence parallelism), on torch.distributed collectives.

* :mod:`.mappings`: the communication operators as autograd Functions (``f``, ``g``, ...).
* :mod:`.layers`: ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``.
* :mod:`.cross_entropy`: ``vocab_parallel_cross_entropy`` (never gathers the logits).
* :mod:`.sharding`: ``parallelize(model, plan, group, sequence_parallel)``.
* :mod:`.accounting`: every collective's kind and bytes (``count_comm``).

A sharded module's full state dict (to save, or to load into another degree) is
:mod:`llmlab.parallel.checkpoint.consolidated`'s ``full_state_dict`` / ``load_full_state_dict``.
The Lightning strategy that runs it, ``TensorParallelStrategy`` (registered as ``"tensor"``), is
a preset of the N-D strategy in :mod:`llmlab.parallel.presets`.
"""

from __future__ import annotations

from llmlab.parallel.tensor.accounting import CommLedger, CommRecord, comm_ledger, count_comm
from llmlab.parallel.tensor.cross_entropy import (
    VocabParallelCrossEntropy,
    vocab_parallel_cross_entropy,
)
from llmlab.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from llmlab.parallel.tensor.mappings import (
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tensor_region,
)
from llmlab.parallel.tensor.random import TensorParallelRNG
from llmlab.parallel.tensor.sharding import (
    parallelize,
    sequence_parallel_parameters,
    validate_plan,
)

__all__ = [
    "ColumnParallelLinear",
    "CommLedger",
    "CommRecord",
    "RowParallelLinear",
    "TensorParallelRNG",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "comm_ledger",
    "copy_to_tensor_region",
    "count_comm",
    "gather_from_sequence_region",
    "gather_from_tensor_region",
    "parallelize",
    "reduce_from_tensor_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tensor_region",
    "sequence_parallel_parameters",
    "validate_plan",
    "vocab_parallel_cross_entropy",
]
