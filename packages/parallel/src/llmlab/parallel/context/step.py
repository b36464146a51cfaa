"""How the N-D strategy trains a context-parallel model: what it checks up front, the loss it
hands the task, and what it does around each step.

**Checks** (:func:`context_problems`, before any process starts): ring attention replaces the
model's attention, so recompute attention (which replaces it too) cannot run with it; it has no
attention dropout; the zigzag split cuts every sequence into ``2N`` equal pieces
(:meth:`~llmlab.parallel.context.layout.ContextLayout.check_length`); ``compile`` was not
checked with its point-to-point transfers inside compiled blocks. A pipeline is refused by the
layout check itself (:mod:`llmlab.parallel.mesh`: stages never see the position ids).

**Loss.** The task's loss is this rank's mean over *its* tokens (``T/N`` of each sequence);
the task weighs it into the global batch's mean over the flattened data × context group
(``ProcessGroups.replica``, ``D·N`` ranks: :mod:`llmlab.parallel.loss_mean`), so its value is
what one process logs, also when padding or masked targets fall unevenly on the context ranks.
Backpropagating that share and averaging gradients over the same ``D·N`` ranks (what the data
reduction or ZeRO already does, with a bigger group) gives one process's gradient: ring
attention carries each share's gradient through the keys and values back to the rank that
produced them, in the one collective the data dimension pays anyway (torchtitan's ``dp_cp``
mesh).

**Steps** (:func:`split_batch`): inside the strategy's training and validation steps (and
backward, where activation checkpointing re-runs the forward) the model runs split, each rank
on its part of the batch along dim 1 (the layout's scheme); anywhere else -- a sampling
callback, decoding after training -- it is the plain model on whole sequences.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from llmlab.parallel.context.group import ContextParallel
from llmlab.parallel.context.layout import ContextLayout

RECOMPUTE_WITH_CONTEXT = (
    "recompute_attention with context > 1 is refused: both replace the model's attention "
    "(ring attention already keeps only O(T/N) per rank and re-sends key/value chunks in "
    "backward instead of storing them); drop model_transforms.recompute_attention or use "
    "context=1"
)
COMPILE_WITH_CONTEXT = (
    "compile=true with context > 1 is refused: ring attention's point-to-point transfers inside "
    "every compiled block were never checked against eager training; use compile=false"
)


def context_problems(
    context: int,
    transforms: Any,
    seq_len: int | None = None,
    attention_dropout: float | None = None,
    scheme: str = "zigzag",
) -> list[str]:
    """Why a run with ``context`` ranks per sequence cannot train, one phrase per problem.

    ``transforms``: the run's :class:`~llmlab.parallel.parallelize.ModelTransforms`;
    ``seq_len``: the training sequence length (the data's block size; ``None``: unknown);
    ``attention_dropout``: the model's dropout on attention probabilities.
    """
    if context == 1:
        return []
    problems = []
    if transforms.recompute_attention is not None:
        problems.append(RECOMPUTE_WITH_CONTEXT)
    if transforms.compile:
        problems.append(COMPILE_WITH_CONTEXT)
    if attention_dropout:
        problems.append(
            f"model dropout={attention_dropout} with context={context}: ring attention has no "
            "attention dropout (each rank sees one key chunk at a time); set model.dropout=0.0"
        )
    if seq_len is not None:
        try:
            ContextLayout(context, scheme).check_length(seq_len)
        except ValueError as err:
            problems.append(f"context={context}: {err}")
    return problems


def check_context(
    context: int,
    transforms: Any,
    seq_len: int | None = None,
    attention_dropout: float | None = None,
) -> None:
    """Raise ``ValueError`` listing every :func:`context_problems`."""
    problems = context_problems(context, transforms, seq_len, attention_dropout)
    if problems:
        raise ValueError("; ".join(problems))


@contextmanager
def split_batch(
    cp: ContextParallel | None, args: tuple[Any, ...] = (), count: bool = True
) -> Generator[tuple[Any, ...], None, None]:
    """Run the model split inside; yields ``args`` with the batch (``args[0]``) cut to this
    rank's tokens: every tensor of two or more dimensions along dim 1. ``cp=None``: as given.
    ``count=False`` (validation): the bytes sent inside are not a training step's
    ``comm/cp_bytes``."""
    if cp is None:
        yield args
        return
    if args:
        args = (apply_to_collection(args[0], Tensor, _shard_sequences, cp), *args[1:])
    before = replace(cp.stats, by_op=dict(cp.stats.by_op))
    with cp.split():
        yield args
    if not count:
        cp.stats.bytes_sent, cp.stats.messages = before.bytes_sent, before.messages
        cp.stats.by_op = before.by_op


def _shard_sequences(x: Tensor, cp: ContextParallel) -> Tensor:
    return cp.shard(x, dim=1) if x.dim() >= 2 else x


def take_cp_bytes(cp: ContextParallel | None) -> int:
    """Bytes this rank's ring attention sent since the last call (``comm/cp_bytes``)."""
    if cp is None:
        return 0
    sent = cp.stats.bytes_sent
    cp.stats.reset()
    return sent
