"""The engine on gloo: loss and every gradient equal single-process training of the same batch.

Oracle: the unsplit GPT, one ``loss.backward()`` on the whole global batch, in this process.
With data parallelism (DP×PP), each pipeline replica runs its share of the global batch and the
gradients are averaged in each stage's data-parallel group; the oracle is still the whole batch.
Tolerance: fp32, 1e-6 absolute and relative (micro-batching only reorders the sums).
Each ``run_distributed`` call batches many (schedule, micro-batch) cases to amortise the ~5 s spawn.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from llmlab.parallel.mesh import ParallelDims, build_process_groups
from llmlab.parallel.pipeline.engine import PipelineEngine
from llmlab.parallel.pipeline.grad_sync import GradientReducer
from llmlab.parallel.pipeline.stage import build_tie_groups, cut_stage
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import lm_loss, tiny_gpt, token_batch

TOL = dict(atol=1e-6, rtol=1e-6)


def unique_params(modules) -> list[torch.nn.Parameter]:
    seen, out = set(), []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _gpt_cases(rank: int, world: int, n_layer: int, cases: list[tuple[str, int, int]]):
    x, y = token_batch()
    out = []
    for name, m, v in cases:
        model = tiny_gpt(n_layer=n_layer)
        ref = copy.deepcopy(model)
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        mods = cut_stage(model.pipeline_layers(), world, rank, v)
        params = unique_params(mods.chunks)
        tied = build_tie_groups(mods, [list(range(world))])
        engine = PipelineEngine(
            mods.chunks, rank, world, loss_fn=lm_loss, reduce_grads=GradientReducer(params, tied)
        )
        result = engine.train_step(x, y, m, name)
        local = {id(p) for p in params}
        checked = 0
        for n, p in model.named_parameters():
            if id(p) in local:
                torch.testing.assert_close(p.grad, ref_grads[n], **TOL, msg=f"{name} m={m} {n}")
                checked += 1
        if result.loss is not None:
            torch.testing.assert_close(result.loss, ref_loss.detach(), **TOL)
        out.append(
            {
                "case": (name, m, v),
                "checked": checked,
                "params": sum(p.numel() for p in params),
                "loss": None if result.loss is None else float(result.loss),
            }
        )
    return out


def _check_results(results, n_layer: int, world: int) -> None:
    total = sum(p.numel() for p in tiny_gpt(n_layer=n_layer).parameters())
    for case_idx in range(len(results[0])):
        per_rank = [r[case_idx] for r in results]
        assert per_rank[-1]["loss"] is not None
        assert all(r["checked"] > 0 for r in per_rank)
        # each rank holds only its stage: the counts add up to the model (+ the tied copy)
        counts = [r["params"] for r in per_rank]
        assert max(counts) < total
        wte = 64 * 32
        assert sum(counts) == total + (wte if world > 1 else 0), counts


@pytest.mark.distributed
def test_gpt_pp2_matches_single_process():
    cases = [(s, m, 1) for s in ("gpipe", "1f1b", "naive") for m in (1, 4, 8)]
    cases += [("interleaved", m, 2) for m in (4, 8)]
    results = run_distributed(_gpt_cases, 2, 2, cases)
    _check_results(results, 2, 2)


@pytest.mark.distributed
def test_gpt_pp4_matches_single_process():
    cases = [("1f1b", 4, 1), ("gpipe", 8, 1), ("interleaved", 8, 2)]
    results = run_distributed(_gpt_cases, 4, 6, cases)
    _check_results(results, 6, 4)


@pytest.mark.distributed
@pytest.mark.slow
def test_gpt_pp4_full_matrix():
    cases = [(s, m, 1) for s in ("gpipe", "1f1b") for m in (1, 4, 8)]
    cases += [("interleaved", m, 2) for m in (4, 8)]
    results = run_distributed(_gpt_cases, 4, 6, cases)
    _check_results(results, 6, 4)


def _gpt_dp_pp_cases(rank: int, world: int, n_layer: int, data: int, cases):
    """``data`` pipeline replicas of ``world // data`` stages; replica d runs rows d·B/data..."""
    dims = ParallelDims(data=data, pipeline=world // data)
    groups = build_process_groups(dims)
    dp, stage = dims.coords(rank)[:2]
    pipelines = [[dims.rank_of(d, s) for s in range(dims.pipeline)] for d in range(data)]
    x, y = token_batch()
    share = x.shape[0] // data
    xs, ys = x[dp * share : (dp + 1) * share], y[dp * share : (dp + 1) * share]
    out = []
    for index, (name, m, v) in enumerate(cases):
        model = tiny_gpt(n_layer=n_layer)
        ref = copy.deepcopy(model)
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        mods = cut_stage(model.pipeline_layers(), dims.pipeline, stage, v)
        params = unique_params(mods.chunks)
        tied = build_tie_groups(mods, pipelines)
        local = {id(p) for p in params}

        engine_for = functools.partial(
            PipelineEngine,
            mods.chunks,
            stage,
            dims.pipeline,
            ranks=pipelines[dp],
            loss_fn=lm_loss,
            group=groups.pipeline,
        )

        if index == 0:
            # control: without the data-parallel average a replica's gradient is that of its
            # own half of the batch, which must differ from the oracle (or this test proves
            # nothing about the reduction)
            engine_for(reduce_grads=GradientReducer(params, tied)).train_step(xs, ys, m, name)
            differs = [
                not torch.allclose(p.grad, ref_grads[n], **TOL)
                for n, p in model.named_parameters()
                if id(p) in local
            ]
            assert all(differs), f"replica {dp} stage {stage}: a local gradient equals the oracle"
            for p in params:
                p.grad = None
        reducer = GradientReducer(params, tied, groups.data, data)
        result = engine_for(reduce_grads=reducer).train_step(xs, ys, m, name)
        checked = 0
        for n, p in model.named_parameters():
            if id(p) in local:
                torch.testing.assert_close(
                    p.grad, ref_grads[n], **TOL, msg=f"{name} m={m} dp={dp} stage={stage} {n}"
                )
                checked += 1
        local_loss = None
        if result.loss is not None:
            # each replica's loss is the mean over its share; equal shares: the mean of the
            # replicas' losses is the global mean
            local_loss = float(result.loss)
            global_loss = result.loss.clone()
            torch.distributed.all_reduce(global_loss, group=groups.data)
            torch.testing.assert_close(global_loss / data, ref_loss.detach(), **TOL)
        out.append({"case": (name, m, v), "checked": checked, "local_loss": local_loss})
    return out


@pytest.mark.distributed
def test_gpt_dp2_pp2_matches_single_process():
    """DP×PP (2×2): after one step (and the data-parallel reduction within each stage's group),
    loss and every parameter's gradient equal single-process training on the global batch."""
    cases = [("gpipe", 2, 1), ("1f1b", 2, 1), ("1f1b", 4, 1), ("interleaved", 2, 2)]
    results = run_distributed(_gpt_dp_pp_cases, 4, 2, 2, cases)
    total = len(list(tiny_gpt(n_layer=2).parameters()))
    for case_idx, case in enumerate(cases):
        per_rank = [r[case_idx] for r in results]
        assert all(r["case"] == case for r in per_rank)
        # ranks 0, 1: replica 0 (stages 0, 1); ranks 2, 3: replica 1. Both replicas checked
        # every parameter of their stage; together a replica's stages cover the whole model.
        assert per_rank[0]["checked"] == per_rank[2]["checked"] > 0
        assert per_rank[1]["checked"] == per_rank[3]["checked"] > 0
        assert per_rank[0]["checked"] + per_rank[1]["checked"] >= total
        losses = [r["local_loss"] for r in per_rank]
        assert losses[0] is None and losses[2] is None  # only last stages hold a loss
        assert losses[1] != losses[3]  # the replicas saw different halves of the batch
