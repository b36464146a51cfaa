"""Context parallelism: a sequence split across ranks, attention computed by a ring.

``layout`` (which tokens each rank holds: zigzag or contiguous, and the attention work that
costs), ``blocks`` (one block's attention with its log-sum-exp, and the merge identity),
``ring`` (the ring-attention autograd function over point-to-point messages), ``loss`` (the
whole sequence's mean loss and the context-group gradient reduction), ``accounting``
(``cp_bytes``, the bytes a rank sends) and ``group`` (``ContextParallel``: all of it for one
process group, plugged into a model through its ``swap_attention``).
"""

from llmlab.parallel.context.accounting import cp_bytes
from llmlab.parallel.context.blocks import BACKENDS, block_backward, block_forward, merge_into
from llmlab.parallel.context.group import ContextParallel
from llmlab.parallel.context.layout import (
    SCHEMES,
    Block,
    ContextLayout,
    attention_work,
    block_plan,
    work_imbalance,
)
from llmlab.parallel.context.loss import reduce_context_gradients, sequence_loss_share
from llmlab.parallel.context.ring import RingAttention, RingTransport, ring_attention

__all__ = [
    "BACKENDS",
    "SCHEMES",
    "Block",
    "ContextLayout",
    "ContextParallel",
    "RingAttention",
    "RingTransport",
    "attention_work",
    "block_backward",
    "block_forward",
    "block_plan",
    "cp_bytes",
    "merge_into",
    "reduce_context_gradients",
    "ring_attention",
    "sequence_loss_share",
    "work_imbalance",
]
