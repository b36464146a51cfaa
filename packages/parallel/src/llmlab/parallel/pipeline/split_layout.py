"""What the N-D strategy needs to run a split-backward schedule (ZB-H1, ZB-V, DualPipeV) exactly.

The engine runs B (input gradient) and W (weight gradients) as separate autograd calls on one
graph (:mod:`~llmlab.parallel.pipeline.split_backward`). Three things change for the layout:

* **where the chunks live**: the V shapes put virtual stages ``r`` and ``2p−1−r`` on rank ``r``,
  so the first *and* the last virtual stage -- the loss -- are on pipeline rank 0
  (:func:`last_stage_rank`, where the loss and the validation output come from);
* **activation checkpointing** must recompute a block once for B and W together
  (:func:`prepare_chunks` switches the wrapped blocks to shared recompute);
* **what cannot be exact is refused up front** (:func:`split_backward_problems`): a compiled
  block's backward is one autograd node computing both gradients, so W would run it again; fp8's
  ``delayed`` recipe advances its gradient amax history on every run of a Linear's backward, and
  a split backward runs that backward in B and again in W, so the history (and the scales of all
  later steps) would differ from an unsplit run. ``dynamic`` fp8 recomputes its scale from the
  gradient itself and is exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from llmlab.parallel.pipeline.partition import chunk_owner
from llmlab.parallel.pipeline.recompute import share_recompute
from llmlab.parallel.pipeline.schedules import SPLIT_BACKWARD, placement


def is_split(schedule: str) -> bool:
    """Whether ``schedule`` runs a split backward (B and W)."""
    return schedule in SPLIT_BACKWARD


def last_stage_rank(schedule: str, num_stages: int, virtual_stages: int) -> int:
    """The pipeline rank holding the last virtual stage (the loss): ``p−1``, or 0 in a V."""
    return chunk_owner(num_stages * virtual_stages - 1, num_stages, placement(schedule))[0]


def split_backward_problems(
    schedule: str, compile: bool, precision_options: Mapping[str, Any] | None = None
) -> list[str]:
    """Why ``schedule`` cannot run exactly with these options (empty when it can).

    ``precision_options``: the precision plugin's options (fp8's ``recipe``), if any.
    """
    if not is_split(schedule):
        return []
    problems = []
    if compile:
        problems.append(
            f"compile=true with schedule={schedule!r} is refused: a compiled block's backward "
            "is one autograd node that computes input and weight gradients together, so the "
            "split backward's W would run it a second time; use compile=false, or an unsplit "
            "schedule (1f1b, interleaved) with compile=true"
        )
    recipe = (precision_options or {}).get("recipe")
    if recipe == "delayed":
        problems.append(
            f"fp8 recipe='delayed' with schedule={schedule!r} is refused: the split backward "
            "runs each fp8 Linear's backward in B and again in W, which would advance its "
            "gradient amax history twice per micro-batch; use recipe='dynamic' (exact under "
            "B/W), or an unsplit schedule (1f1b, interleaved)"
        )
    return problems


def check_split_backward(
    schedule: str, compile: bool, precision_options: Mapping[str, Any] | None = None
) -> None:
    """Raise ``ValueError`` with every problem of :func:`split_backward_problems`."""
    problems = split_backward_problems(schedule, compile, precision_options)
    if problems:
        raise ValueError("; ".join(problems))


def prepare_chunks(schedule: str, chunks: list[nn.Module]) -> int:
    """Under a split schedule, make the checkpointed blocks of ``chunks`` recompute once for B
    and W together; returns how many blocks were switched (0 for an unsplit schedule)."""
    if not is_split(schedule):
        return 0
    return sum(share_recompute(chunk) for chunk in chunks)
