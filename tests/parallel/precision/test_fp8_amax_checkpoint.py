"""fp8 delayed scaling keeps one amax history per tensor rank through a checkpoint (issue 24).

Each tensor rank quantises its own weight slice (and the row-parallel input slice, the
column-parallel gradient slice), so its histories differ from the other rank's; before the fix
the checkpoint kept tensor rank 0's copy and resumed both ranks from it.

On 2 gloo ranks, TP=2, ``FP8Precision(recipe="delayed")`` (emulated), 3 real ``Trainer`` steps:
the two ranks' histories must differ (else the test proves nothing), then a consolidated and a
sharded checkpoint each resume (no further step) into TP=2, where every rank's history equals
what it saved, exactly; and into data=2 × TP=1, where each rank's history is the element-wise max
of the two saved ranks' (a merged slice's amax is the max of its parts'). The degree rules for a
split and for degrees that divide neither way are checked on :func:`history_for_rank` directly.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.training import fit

MODEL = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=64, dropout=0.0)
STEPS = 3


def _plugin():
    from llmlab.parallel.precision import FP8Precision

    return FP8Precision(min_features=64, recipe="delayed", history_len=4, backend="emulate")


def _histories(trainer) -> dict[str, torch.Tensor]:
    from llmlab.parallel.checkpoint.fp8_state import amax_histories

    return {k: v.detach().clone() for k, v in amax_histories(trainer.lightning_module).items()}


def _run(rank: int, world: int, root: str) -> dict:
    from llmlab.parallel.strategy import NDParallelStrategy

    out: dict = {}
    for fmt in ("consolidated", "sharded"):
        sharded = fmt == "sharded"
        path = os.path.join(root, f"{fmt}.ckpt")
        strategy = NDParallelStrategy(
            tensor=2, sharded_checkpoints=sharded, timeline_every_n_steps=0
        )
        run = fit(strategy, world, MODEL, steps=STEPS, plugins=[_plugin()], lr=1e-3)
        run["trainer"].save_checkpoint(path)
        out[f"{fmt} saved"] = _histories(run["trainer"])
        for name, layout in (("tp2", dict(tensor=2)), ("dp2", dict(data=2))):
            strategy = NDParallelStrategy(
                **layout, sharded_checkpoints=sharded, timeline_every_n_steps=0
            )
            again = fit(strategy, world, MODEL, STEPS, plugins=[_plugin()], ckpt_path=path)
            assert not again["losses"], "resumed at max_steps: no step may run"
            out[f"{fmt} {name}"] = _histories(again["trainer"])
    return out


@pytest.mark.distributed
def test_each_tensor_rank_resumes_its_own_amax_history(tmp_path) -> None:
    ranks = run_distributed(_run, 2, str(tmp_path), timeout=600)
    for fmt in ("consolidated", "sharded"):
        saved = [r[f"{fmt} saved"] for r in ranks]
        names = sorted(saved[0])
        assert len(names) >= 6, names  # qkv, proj, fc, mlp proj × (input, weight, grad)
        differ = [n for n in names if not torch.equal(saved[0][n], saved[1][n])]
        assert differ, "the two tensor ranks' histories must differ for the test to mean much"
        assert all(bool((saved[0][n] > 0).any()) for n in names), "histories were written"
        for rank in (0, 1):
            resumed, merged = ranks[rank][f"{fmt} tp2"], ranks[rank][f"{fmt} dp2"]
            for n in names:
                assert torch.equal(resumed[n], saved[rank][n]), (fmt, rank, n)  # exact
                expected = torch.maximum(saved[0][n], saved[1][n])
                assert torch.equal(merged[n], expected), (fmt, rank, n)  # exact


def test_degree_changes_merge_by_max_split_from_the_parent_and_reset_otherwise() -> None:
    from llmlab.parallel.checkpoint.fp8_state import history_for_rank

    saved = torch.tensor([[1.0, 5.0], [3.0, 2.0], [0.5, 7.0], [4.0, 4.0]])
    own, warning = history_for_rank(saved, 2, 4)  # same degree: its own
    assert torch.equal(own, saved[2]) and warning is None
    merged, warning = history_for_rank(saved, 1, 2)  # 4 -> 2: ranks 2, 3 merge
    assert torch.equal(merged, torch.tensor([4.0, 7.0])) and warning is None
    split, warning = history_for_rank(saved[:2], 3, 4)  # 2 -> 4: rank 3 lies in saved rank 1
    assert torch.equal(split, saved[1]) and "upper bound" in warning
    reset, warning = history_for_rank(saved[:3], 0, 2)  # 3 -> 2: no rule
    assert torch.equal(reset, torch.zeros(2)) and "reset" in warning
