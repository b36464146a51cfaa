"""Hugging Face-format folders in and out (``config.json`` + safetensors), without
``transformers``: :func:`from_pretrained`, :func:`save_pretrained`, and :func:`read_weights`,
which reads only the parameters and slices asked for."""

from llmlab.models.hf.folder import CheckpointError, CheckpointFolder
from llmlab.models.hf.pretrained import (
    check_pretrained,
    from_pretrained,
    pretrained_spec,
    read_weights,
    save_pretrained,
)
from llmlab.models.hf.weights import Shard, tensor_parallel_shards

__all__ = [
    "CheckpointError",
    "CheckpointFolder",
    "Shard",
    "check_pretrained",
    "from_pretrained",
    "pretrained_spec",
    "read_weights",
    "save_pretrained",
    "tensor_parallel_shards",
]
