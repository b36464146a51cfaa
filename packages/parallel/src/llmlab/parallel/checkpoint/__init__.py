"""Sharded checkpoints: each rank writes only its shards; any layout reads them back.

``save_zero`` / ``load_zero`` move a :class:`~llmlab.parallel.data.zero.ZeroEngine`'s parameters
and optimizer state through ``torch.distributed.checkpoint`` under the unsharded parameter names;
``consolidate`` (or ``python -m llmlab.parallel.checkpoint consolidate <dir> <out.pt>``) turns a
sharded checkpoint into one ``state_dict`` that a plain model loads. An N-D layout's Trainer
checkpoints (``NDParallelStrategy(sharded_checkpoints=True)``) use the same format through
:class:`~llmlab.parallel.checkpoint.layout_state.LayoutState`.
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
from llmlab.parallel.checkpoint.layout_state import LayoutState
from llmlab.parallel.checkpoint.zero_state import (
    consolidate,
    load_zero,
    read_extra,
    save_zero,
    sharded_state_dict,
)

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
    "sharded_state_dict",
]
