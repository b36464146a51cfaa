"""The tensor-parallel tests' GPT and the bytes its tensor parallelism must move per step.

Shared by ``test_gpt_tensor_parallel.py`` (the sharded model against one process) and
``test_strategy.py`` (the same model inside ``Trainer``, whose logged ``comm/tp_bytes`` must equal
the same count).
"""

from __future__ import annotations

from tests.helpers.tiny import tiny_gpt_config

CFG = tiny_gpt_config(n_head=4, dropout=0.0)
B, T = 2, 8  # rows and sequence length of one batch


def expected_comm(tp: int, sp: bool, rows: int = B) -> dict[str, int]:
    """Payload bytes of one forward + backward (fp32), derived from Megatron-LM's layout.

    Without SP: all-reduces of B×T×d: per layer 2 forward (attention out, MLP down) and 2 backward
    (attention in, MLP up), plus the embedding (forward) and the LM head's input (backward).
    With SP each becomes an all-gather + a reduce-scatter of the same B×T×d; the position
    table's chunk costs a T×d all-gather (backward); the replicated LayerNorm weights/biases and
    row-parallel biases (6d per layer + 2d for ln_f) have their gradients all-reduced.
    Either way the loss all-reduces three B×T numbers (max, target logit, sum of exps).
    """
    L, d = CFG["n_layer"], CFG["n_embd"]
    act = rows * T * d * 4
    loss = 3 * rows * T * 4
    if not sp:
        return {"all_reduce": (4 * L + 2) * act + loss, "all_gather": 0, "reduce_scatter": 0}
    return {
        "all_reduce": (6 * L + 2) * d * 4 + loss,
        "all_gather": (4 * L + 2) * act + T * d * 4,
        "reduce_scatter": (4 * L + 2) * act,
    }
