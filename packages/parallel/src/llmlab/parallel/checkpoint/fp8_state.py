"""fp8 delayed-scaling state per tensor rank: every rank's own amax histories, saved and restored.

Each tensor-parallel rank quantises its own slice of a weight (and, for a row-parallel layer, its
own slice of the input; for a column-parallel one, its own slice of the output gradient), so its
amax history differs from the other ranks'. The model's state dict keeps one copy of each history
(tensor rank 0's, what a one-device model loads); the checkpoint key :data:`AMAX_KEY` keeps all of
them, ``name -> (tensor ranks, history_len)`` in tensor-rank order, gathered over the pipeline
too. The scale is not state: it is ``FP8_MAX / max(history)``
(:mod:`llmlab.parallel.precision.fp8`), so restoring the history restores the scale.

On resume rank ``r`` of ``T_new`` tensor ranks reads from ``T_old`` saved rows:

* ``T_old == T_new``: row ``r``, its own history.
* ``T_old = k·T_new`` (ranks merged): the element-wise max of rows ``r·k .. r·k+k-1``. Exact: a
  merged slice's amax at each step is the max of its parts' amaxes (the history slots of all ranks
  are written at the same steps).
* ``T_new = k·T_old`` (ranks split): row ``r // k``, the history of the slice that contains this
  rank's -- an upper bound on its own amax, so nothing saturates; the scale is at most that much
  coarser until ``history_len`` steps have replaced it. Logged as a warning.
* otherwise: zeros (the first step falls back to the current amax), logged as a warning.

Data replicas see different batches and so keep different histories too; data rank 0's are saved
and every replica resumes from them (there is one copy per tensor rank, not per data rank).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llmlab.parallel.checkpoint import consolidated as C
from llmlab.parallel.mesh import ProcessGroups
from llmlab.parallel.precision.fp8 import AmaxHistory

log = logging.getLogger(__name__)

AMAX_KEY = "llmlab_fp8_amax_by_tensor_rank"


def amax_histories(module: nn.Module) -> dict[str, Tensor]:
    """``state-dict key -> history buffer`` of every fp8 amax history ``module`` holds here."""
    ids = {id(m.history) for m in module.modules() if isinstance(m, AmaxHistory)}
    named = C.named_state(module)
    return {k: t for k, (t, _) in named.items() if id(t) in ids and not t.is_meta}


def gather_amax(module: nn.Module, groups: ProcessGroups) -> dict[str, Tensor]:
    """Every tensor rank's histories stacked, ``(tensor ranks, history_len)`` (a collective over
    the tensor and pipeline groups; empty without fp8 delayed-scaling layers anywhere)."""
    named = {k: (t.unsqueeze(0), 0) for k, t in amax_histories(module).items()}
    return C.gather_full(named, groups.tensor, groups.pipeline)


def history_for_rank(saved: Tensor, rank: int, size: int) -> tuple[Tensor, str | None]:
    """Rank ``rank`` of ``size``'s history from ``saved`` rows (module docstring), with a warning
    to log when it is not exactly this rank's own."""
    rows = saved.shape[0]
    if rows == size:
        return saved[rank], None
    if rows % size == 0:
        k = rows // size
        return saved[rank * k : (rank + 1) * k].amax(dim=0), None
    if size % rows == 0:
        parent = rank // (size // rows)
        return saved[parent], (
            f"tensor degree {rows} -> {size}: rank {rank} starts from the history of saved "
            f"rank {parent}, whose slice contains its own (an upper bound on its amax)"
        )
    return torch.zeros_like(saved[0]), (
        f"tensor degree {rows} -> {size} does not divide either way: amax histories reset "
        "(the first step uses the current amax)"
    )


def restore_amax(module: nn.Module, saved: Mapping[str, Tensor], groups: ProcessGroups) -> None:
    """Copy this tensor rank's history (module docstring) into each history ``module`` holds;
    names the checkpoint lacks keep what the model state loaded."""
    size = groups.dims.tensor
    rank = dist.get_rank(groups.tensor) if size > 1 else 0
    warnings = set()
    with torch.no_grad():
        for name, history in amax_histories(module).items():
            if name not in saved:
                continue
            value, warning = history_for_rank(saved[name], rank, size)
            if value.shape != history.shape:
                raise ValueError(
                    f"{name}: saved amax history of length {value.shape[0]} does not fit this "
                    f"model's history_len {history.shape[0]}"
                )
            history.copy_(value)
            if warning:
                warnings.add(warning)
    for warning in sorted(warnings):
        log.warning("fp8 amax: %s", warning)


def add_amax(
    checkpoint: MutableMapping[str, Any], module: nn.Module, groups: ProcessGroups
) -> None:
    """Put every tensor rank's histories under :data:`AMAX_KEY` (a collective; nothing without
    fp8 layers)."""
    stacked = gather_amax(module, groups)
    if stacked:
        checkpoint[AMAX_KEY] = stacked
