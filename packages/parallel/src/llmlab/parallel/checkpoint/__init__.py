"""Every checkpoint format of llmlab.parallel, and the only place that knows them.

* :mod:`.checkpointer`: :class:`LayoutCheckpointer`, the one door an N-D layout's model,
  optimizer and precision-plugin state goes through (what ``NDParallelStrategy`` calls);
* :mod:`.consolidated`: full tensors by name, gathered over the tensor and pipeline groups and
  sliced back (one file, rank 0 writes it); ``full_state_dict`` for a sharded module alone;
* :mod:`.layout_state`, :mod:`.boxes`, :mod:`.files`: the sharded format -- each rank writes
  only its boxes through ``torch.distributed.checkpoint``, any layout reads them back;
  ``consolidate`` (``python -m llmlab.parallel.checkpoint consolidate <dir> <out.pt>``) makes
  one ``state_dict`` of it;
* :mod:`.zero_state`: a ZeRO engine's pieces by name (gathered, loaded) and ``save_zero`` /
  ``load_zero`` for an engine on its own;
* :mod:`.deepspeed_state`: a DeepSpeed checkpoint directory as one ``state_dict``;
* :mod:`.torch_file`: the one-file format written atomically (``AtomicCheckpointIO``) and
  ``checkpoint_problem``, which checks any kind whole before a resume starts.

Every format keys tensors by the *unsplit* model's names, so any layout's checkpoint loads into
any other layout and into a plain model.
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
from llmlab.parallel.checkpoint.torch_file import (
    AtomicCheckpointIO,
    atomic_torch_save,
    checkpoint_problem,
)
from llmlab.parallel.checkpoint.zero_state import load_zero, save_zero

__all__ = [
    "AtomicCheckpointIO",
    "LayoutState",
    "ShardedView",
    "atomic_torch_save",
    "checkpoint_problem",
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
