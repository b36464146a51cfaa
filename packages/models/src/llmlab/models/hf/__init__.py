"""Hugging Face-format folders in and out (``config.json`` + safetensors), without
``transformers``: :func:`from_pretrained`, :func:`save_pretrained`, and :func:`read_weights`,
which reads only the parameters and slices asked for;
:class:`PretrainedWeights`, the same by llmlab name, for a layout that fills a ``meta`` model."""

from llmlab.models.hf.folder import CheckpointError, CheckpointFolder
from llmlab.models.hf.pretrained import (
    check_pretrained,
    from_pretrained,
    pretrained_spec,
    read_weights,
    save_pretrained,
)
from llmlab.models.hf.source import PretrainedWeights, build_model_unloaded
from llmlab.models.hf.weights import Shard, tensor_parallel_shards

__all__ = [
    "CheckpointError",
    "CheckpointFolder",
    "PretrainedWeights",
    "Shard",
    "build_model_unloaded",
    "check_pretrained",
    "from_pretrained",
    "pretrained_spec",
    "read_weights",
    "save_pretrained",
    "tensor_parallel_shards",
]
