"""Sharded checkpoints: each rank writes only its shards; any layout reads them back.

:class:`~llmlab.parallel.checkpoint.layout_state.LayoutState` moves any N-D layout's model and
optimizer state (tensor-parallel slices, pipeline stages, ZeRO pieces, fp32 masters) through
``torch.distributed.checkpoint`` under the unsharded tensor names: the N-D strategy's Trainer
checkpoints (``NDParallelStrategy(sharded_checkpoints=True)``) and ``save_zero`` / ``load_zero``
(a :class:`~llmlab.parallel.data.zero.ZeroEngine` alone) use it. ``consolidate`` (or
``python -m llmlab.parallel.checkpoint consolidate <dir> <out.pt>``) turns a sharded checkpoint
into one ``state_dict`` that a plain model loads.
"""

from llmlab.parallel.checkpoint.boxes import ShardedView, flat_boxes
from llmlab.parallel.checkpoint.files import (
    is_sharded,
    load,
    metadata,
    problem,
    read_full,
    save,
)
from llmlab.parallel.checkpoint.layout_state import LayoutState, consolidate, read_extra
from llmlab.parallel.checkpoint.zero_state import load_zero, save_zero

__all__ = [
    "LayoutState",
    "ShardedView",
    "consolidate",
    "flat_boxes",
    "is_sharded",
    "load",
    "load_zero",
    "metadata",
    "problem",
    "read_extra",
    "read_full",
    "save",
    "save_zero",
]
