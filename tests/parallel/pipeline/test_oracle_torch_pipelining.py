"""Our engine against ``torch.distributed.pipelining`` (ScheduleGPipe, Schedule1F1B), an oracle
nobody here wrote. torch's stages do not handle weights tied across stages, so the GPT here has
untied embeddings. torch scales each stage's gradients by 1/m (``scale_grads``), as our engine's
``loss / m`` does. Tolerance: fp32, 1e-6 (abs and rel) on the loss and every gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from llmlab.models import GPT, GPTConfig
from llmlab.parallel.pipeline.engine import PipelineEngine
from llmlab.parallel.pipeline.grad_sync import GradientReducer
from llmlab.parallel.pipeline.stage import cut_stage
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import lm_loss, tiny_gpt_config, token_batch

TOL = dict(atol=1e-6, rtol=1e-6)


def _versus_torch(rank: int, world: int, cases: list[tuple[str, int]]):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    x, y = token_batch()
    out = []
    for name, m in cases:
        torch.manual_seed(0)
        cfg = GPTConfig(**tiny_gpt_config(), tie_embeddings=False)
        ours_model = GPT(cfg)
        theirs_model = copy.deepcopy(ours_model)

        ours = cut_stage(ours_model.pipeline_layers(), world, rank)
        params = [p for c in ours.chunks for p in c.parameters()]
        engine = PipelineEngine(
            ours.chunks, rank, world, loss_fn=lm_loss, reduce_grads=GradientReducer(params)
        )
        result = engine.train_step(x, y, m, name)

        theirs = cut_stage(theirs_model.pipeline_layers(), world, rank)
        stage = PipelineStage(nn.Sequential(*theirs.chunks[0]), rank, world, torch.device("cpu"))
        sched_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
        schedule = sched_cls(stage, n_microbatches=m, loss_fn=lm_loss)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()

        mine = dict(ours_model.named_parameters())
        for n, p in theirs_model.named_parameters():
            if n in mine and mine[n].grad is not None:
                assert p.grad is not None, n
                torch.testing.assert_close(mine[n].grad, p.grad, **TOL, msg=f"{name} m={m} {n}")
        if result.loss is not None:
            torch.testing.assert_close(result.loss, torch.stack(losses).mean(), **TOL)
        out.append((name, m, len(params)))
    return out


@pytest.mark.distributed
def test_engine_matches_torch_pipelining_pp2():
    cases = [("gpipe", 4), ("1f1b", 4), ("1f1b", 8)]
    results = run_distributed(_versus_torch, 2, cases, timeout=600)
    assert all(n > 0 for r in results for _, _, n in r)
