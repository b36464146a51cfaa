"""ZB-H1, ZB-V and DualPipeV on gloo ranks: gradients equal torch's schedules and one process.

Two oracles for every case, both nobody here wrote: ``torch.distributed.pipelining`` running the
same schedule (``ScheduleInterleavedZeroBubble`` with one stage per rank is ZB-H1,
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) on stages cut identically from a copy of the
model, fed the same micro-batches; and the unsplit model's one ``loss.backward()`` on the whole
batch in this process. Models: the tiny GPT (untied embeddings: torch's stages do not tie
weights) and the tiny Llama (GQA), over 2 and 4 ranks (V shapes: 4 and 8 virtual stages). A
tied GPT (embedding and head both on rank 0 in the V) is checked against one process. torch
scales each stage's gradients by 1/m, as our ``loss / m``. Tolerance: fp32, 1e-6 absolute and
relative on the loss and every gradient. One spawn runs many cases (the spawn costs ~5 s).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from llmlab.models import GPT, GPTConfig, Llama, LlamaConfig
from llmlab.parallel.pipeline.engine import PipelineEngine
from llmlab.parallel.pipeline.grad_sync import GradientReducer
from llmlab.parallel.pipeline.partition import local_virtual_stages
from llmlab.parallel.pipeline.schedules import placement
from llmlab.parallel.pipeline.stage import cut_stage
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import lm_loss, tiny_gpt_config, token_batch

TOL = dict(atol=1e-6, rtol=1e-6)
LLAMA = dict(
    vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
    intermediate_size=48,
)  # fmt: skip
VIRTUAL = {"zb1": 1, "zbv": 2, "dualpipev": 2}


def _model(kind: str, world: int) -> nn.Module:
    """Enough layers for 2 virtual stages per rank (``[embed, *blocks, head]``)."""
    n_layer = 2 if world == 2 else 6
    torch.manual_seed(0)
    if kind == "llama":
        return Llama(LlamaConfig(**{**LLAMA, "n_layer": n_layer}))
    return GPT(GPTConfig(**tiny_gpt_config(n_layer=n_layer), tie_embeddings=kind == "gpt_tied"))


def _torch_schedule(name: str, stages: list, m: int):
    from torch.distributed.pipelining import (
        ScheduleDualPipeV,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    cls = {
        "zb1": ScheduleInterleavedZeroBubble,
        "zbv": ScheduleZBVZeroBubble,
        "dualpipev": ScheduleDualPipeV,
    }[name]
    return cls(stages, n_microbatches=m, loss_fn=lm_loss)


def _run_torch(model: nn.Module, name: str, m: int, rank: int, world: int, x, y) -> list:
    from torch.distributed.pipelining import PipelineStage

    v = VIRTUAL[name]
    where = placement(name)
    mods = cut_stage(model.pipeline_layers(), world, rank, v, placement=where)
    stages = [
        PipelineStage(chunk, vs, world * v, torch.device("cpu"))
        for chunk, vs in zip(mods.chunks, local_virtual_stages(rank, world, v, where), strict=True)
    ]
    sched = _torch_schedule(name, stages, m)
    losses: list[torch.Tensor] = []
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    kwargs = {"target": y, "losses": losses} if last else {}
    sched.step(*((x,) if first else ()), **kwargs)
    return losses


def _compare(model: nn.Module, local: set[int], oracle: dict, label: str) -> int:
    """Every gradient this rank holds against the oracle's parameter of the same name."""
    checked = 0
    for n, p in model.named_parameters():
        if id(p) in local:
            torch.testing.assert_close(p.grad, oracle[n].grad, **TOL, msg=f"{label}: {n}")
            checked += 1
    return checked


def _cases(rank: int, world: int, cases: list[tuple[str, str, int]]) -> list[dict]:
    x, y = token_batch()
    out = []
    for kind, name, m in cases:
        model = _model(kind, world)
        ref = copy.deepcopy(model)
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        ref_grads = dict(ref.named_parameters())

        v = VIRTUAL[name]
        mods = cut_stage(model.pipeline_layers(), world, rank, v, placement=placement(name))
        params = list({id(p): p for c in mods.chunks for p in c.parameters()}.values())
        engine = PipelineEngine(
            mods.chunks, rank, world, loss_fn=lm_loss, reduce_grads=GradientReducer(params)
        )
        result = engine.train_step(x, y, m, name)
        local = {id(p) for p in params}
        checked = _compare(model, local, ref_grads, f"{kind} {name} m={m} vs 1 process")
        if result.loss is not None:
            torch.testing.assert_close(result.loss, ref_loss.detach(), **TOL)

        compared = 0
        if kind != "gpt_tied":
            theirs = copy.deepcopy(_model(kind, world))
            losses = _run_torch(theirs, name, m, rank, world, x, y)
            their_grads = dict(theirs.named_parameters())
            compared = _compare(model, local, their_grads, f"{kind} {name} m={m} vs torch")
            if result.loss is not None:
                torch.testing.assert_close(result.loss, torch.stack(losses).mean(), **TOL)
        out.append({"case": (kind, name, m), "checked": checked, "vs_torch": compared})
    return out


def _check(results: list[list[dict]], cases: list[tuple[str, str, int]]) -> None:
    for index, case in enumerate(cases):
        per_rank = [r[index] for r in results]
        assert all(r["case"] == case for r in per_rank)
        assert all(r["checked"] > 0 for r in per_rank), per_rank
        if case[0] != "gpt_tied":
            assert [r["vs_torch"] for r in per_rank] == [r["checked"] for r in per_rank]


PP2 = [(k, s, 4) for k in ("gpt", "llama") for s in ("zb1", "zbv", "dualpipev")]
PP2 += [("gpt_tied", "zbv", 4)]


@pytest.mark.distributed
def test_zero_bubble_pp2_matches_torch_and_one_process():
    results = run_distributed(_cases, 2, PP2, timeout=600)
    _check(results, PP2)


@pytest.mark.distributed
def test_zbv_pp4_llama_matches_torch_and_one_process():
    cases = [("llama", "zbv", 8)]
    results = run_distributed(_cases, 4, cases, timeout=600)
    _check(results, cases)


@pytest.mark.distributed
@pytest.mark.slow
def test_zero_bubble_pp4_full_matrix():
    cases = [(k, s, 8) for k in ("gpt", "llama") for s in ("zb1", "zbv", "dualpipev")]
    cases += [("gpt", "zb1", 4), ("llama", "zbv", 2), ("gpt_tied", "dualpipev", 8)]
    results = run_distributed(_cases, 4, cases, timeout=900)
    _check(results, cases)
