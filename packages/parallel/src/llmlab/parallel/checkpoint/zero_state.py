"""A :class:`~llmlab.parallel.data.zero.ZeroEngine` on its own (a plain data-parallel loop, no
Trainer) as a sharded checkpoint: :class:`~llmlab.parallel.checkpoint.layout_state.LayoutState`
with the engine's data group as the only dimension.

A rank writes only the boxes its shard covers, and on load asks for the boxes of *its* layout,
so a checkpoint written at ``dp=2, zero=1`` loads at ``dp=4, zero=3``, at stage 0, into the N-D
strategy, or -- consolidated -- into a plain model. Keys are the model's state-dict names.
"""

from __future__ import annotations

import os
from typing import Any

from torch.optim import Optimizer

from llmlab.parallel.checkpoint.layout_state import LayoutState, read_extra
from llmlab.parallel.data.zero import ZeroEngine


def _layout_state(engine: ZeroEngine) -> LayoutState:
    return LayoutState(
        engine.module,
        coords=(engine.rank, 0, 0),
        tensor_size=1,
        data_size=engine.world,
        zero=engine,
        group=engine.group,
    )


def save_zero(
    path: str | os.PathLike,
    engine: ZeroEngine,
    optimizer: Optimizer | None = None,
    extra: Any = None,
) -> None:
    """Write the engine's shards (and the optimizer's) to ``path``; a collective over the
    engine's group."""
    _layout_state(engine).save(path, [optimizer] if optimizer is not None else [], extra)


def load_zero(
    path: str | os.PathLike, engine: ZeroEngine, optimizer: Optimizer | None = None
) -> Any:
    """Load ``path`` into this rank's shards, whatever layout wrote it; returns ``extra``.

    The optimizer (already rewired) gets fresh state tensors shaped like this rank's pieces,
    filled from disk, and its param groups' settings (learning rate...) are restored.
    """
    _layout_state(engine).load(path, [optimizer] if optimizer is not None else [])
    engine.refresh_params()
    return read_extra(path)
