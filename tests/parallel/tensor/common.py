"""The tensor-parallel tests' GPT and the bytes its tensor parallelism must move per step.

Shared by ``test_gpt_tensor_parallel.py`` (the sharded model against one process) and
``test_strategy.py`` (the same model inside ``Trainer``, whose logged ``comm/tp_bytes`` must equal
the same count).
"""

from __future__ import annotations

from tests.helpers.tiny import tiny_gpt_config

CFG = tiny_gpt_config(n_head=4, dropout=0.0)
B, T = 2, 8  # rows and sequence length of one batch


def tp_step_bytes(
    *,
    rows: int,
    seq: int,
    width: int,
    layers: int,
    sp: bool,
    microbatches: int = 1,
    embedding: bool = True,
    head: bool = True,
) -> dict[str, int]:
    """Payload bytes (fp32) one tensor-parallel rank moves in one step for a model piece of
    ``layers`` blocks that may hold the embedding (``e``) and the head (``h``): the README's
    formula for every stage shape (first: e; middle: neither; last: h; one stage: both).

    Without SP, all-reduces of ``a = rows×seq×width`` values: per block 2 forward (attention
    out, MLP down) and 2 backward (attention in, MLP up); the embedding's output (forward, e)
    and the LM head's input (backward, h). With SP each becomes an all-gather plus a
    reduce-scatter of the same ``a``; per micro-batch the replicated LayerNorm weights/biases
    and row-parallel biases (6·width per block, 2·width for ln_f: h) have their gradients
    all-reduced, and the position table's chunk costs a seq×width all-gather (e). The
    vocab-parallel loss (h) all-reduces three rows×seq numbers (max, target logit, sum of exps).
    """
    a = rows * seq * width * 4
    ends = int(embedding) + int(head)
    loss = 3 * rows * seq * 4 if head else 0
    if not sp:
        return {"all_reduce": (4 * layers + ends) * a + loss, "all_gather": 0, "reduce_scatter": 0}
    return {
        "all_reduce": microbatches * (6 * layers + 2 * int(head)) * width * 4 + loss,
        "all_gather": (4 * layers + ends) * a + int(embedding) * microbatches * seq * width * 4,
        "reduce_scatter": (4 * layers + ends) * a,
    }


def expected_comm(tp: int, sp: bool, rows: int = B) -> dict[str, int]:
    """``tp_step_bytes`` of the whole ``CFG`` model on one stage (it holds both ends)."""
    return tp_step_bytes(rows=rows, seq=T, width=CFG["n_embd"], layers=CFG["n_layer"], sp=sp)
