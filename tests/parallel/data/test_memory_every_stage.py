"""``memory/*_bytes`` are logged at every ZeRO stage, 0 included, and count what each rank holds.

Issue 24: the N-D strategy logged them only when a ZeRO engine existed, so ``zero=0`` and
``zero=1`` runs could not be compared. On 2 gloo ranks (data=2), the tiny GPT in fp32 with AdamW,
2 real ``Trainer`` steps, against the count from the model's parameters (``N`` elements in ``P``
tensors, ``U`` ZeRO units = blocks + the rest, ``dp = 2``, 4 bytes an element):

* zero=0: params = 4N, grads = 4N, optim = 8N + 4P (exp_avg and exp_avg_sq per element, AdamW's
  fp32 ``step`` per tensor) -- exactly.
* zero=1: params 4N, grads 4N (the full buffer) + 4N/dp (the shard); stage 2: params 4N, grads
  4N/dp; stage 3: params 4N/dp, grads 4N/dp. Each unit is padded to a multiple of dp, so a term
  may exceed its share by up to (dp-1)·U elements.
* stages 1-3: optim = 8·(the elements this rank's pieces hold) + 4·(its pieces); the ranks'
  moment elements add up to N exactly, and each is N/dp within (dp-1)·U.
"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.training import fit

MODEL = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
DP = 2


def _run(rank: int, world: int) -> dict:
    from llmlab.parallel.strategy import NDParallelStrategy

    out = {}
    for zero in range(4):
        strategy = NDParallelStrategy(data=world, zero=zero, timeline_every_n_steps=0)
        trainer = fit(strategy, world, MODEL, steps=2)["trainer"]
        logged = {k: v for k, v in trainer.strategy.last_comm.items() if k.startswith("memory/")}
        pieces = len(trainer.optimizers[0].state)  # tensors with AdamW state on this rank
        out[zero] = {"logged": logged, "pieces": pieces}
    return out


def _parameter_count() -> tuple[int, int]:
    from llmlab.models import build_model

    params = list(build_model(MODEL).parameters())  # unique: a tied weight counts once
    return sum(p.numel() for p in params), len(params)


@pytest.mark.distributed
def test_memory_bytes_at_zero_0_to_3_match_the_parameters_each_rank_holds() -> None:
    ranks = run_distributed(_run, DP, timeout=600)
    n, p = _parameter_count()
    slack = 4 * (DP - 1) * (MODEL["n_layer"] + 1)  # padding bytes a term may carry
    for rank, by_stage in enumerate(ranks):
        zero0 = by_stage[0]["logged"]
        assert zero0 == {
            "memory/params_bytes": 4.0 * n,
            "memory/grads_bytes": 4.0 * n,
            "memory/optim_bytes": 8.0 * n + 4 * p,
            "memory/peak_bytes": 16.0 * n + 4 * p,
        }, rank
        expected = {1: (4 * n, 4 * n + 4 * n / DP), 2: (4 * n, 4 * n / DP), 3: (4 * n / DP,) * 2}
        for stage, (params, grads) in expected.items():
            got = by_stage[stage]["logged"]
            assert 0 <= got["memory/params_bytes"] - params <= 2 * slack, (rank, stage)
            assert 0 <= got["memory/grads_bytes"] - grads <= 2 * slack, (rank, stage)
            moments = got["memory/optim_bytes"] - 4 * by_stage[stage]["pieces"]
            assert abs(moments - 8 * n / DP) <= 2 * slack, (rank, stage)
            assert got["memory/peak_bytes"] >= sum(got[f"memory/{k}_bytes"] for k in
                                                   ("params", "grads", "optim")) - 1  # fmt: skip
    for stage in (1, 2, 3):  # the moments the ranks hold add up to zero=0's exactly
        moments = [r[stage]["logged"]["memory/optim_bytes"] - 4 * r[stage]["pieces"] for r in ranks]
        assert sum(moments) == 8 * n, stage
