"""The tensor-parallel GPT equals the single-process GPT: logits, loss, every gradient, 20 steps.

Oracle: the same ``llmlab.models.GPT`` in one process with ``F.cross_entropy`` (fp32; 1e-5).
Also measured here: each rank's share of every sharded weight (1/tp), and the bytes moved per
training step against the analytical count written out in ``common.expected_comm``.
One distributed function per world size (2: tp=2; 4: tp=4 and DP×TP = 2×2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmlab.models import GPT, GPTConfig
from tests.helpers.distributed import run_distributed
from tests.parallel.tensor.common import CFG, B, T, expected_comm

STEPS = 20
TOL = dict(atol=1e-5, rtol=1e-5)  # fp32, single process vs sharded sums


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def batch(step: int, rows: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, CFG["vocab_size"], (rows, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _full_grads(model, group) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        dim = getattr(p, "tp_shard_dim", None)
        out[name] = p.grad if dim is None else _gather(p.grad, dim, group)
    return out


def _tp_loss(model, x, y, group):
    from llmlab.parallel.tensor import vocab_parallel_cross_entropy

    logits = model(x)
    return logits, vocab_parallel_cross_entropy(logits.flatten(0, 1), y.flatten(), group)


def _check_exact_and_counted(rank: int, tp: int, group, sp: bool) -> tuple[GPT, GPT]:
    from llmlab.parallel.tensor import count_comm, parallelize

    ref = make_gpt()
    model = parallelize(make_gpt(), GPT.tensor_parallel_plan(), group, sequence_parallel=sp)
    what = f"tp={tp} sp={sp} rank={rank}"

    # Each rank holds 1/tp of every sharded weight (measured on the live parameters).
    full = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if hasattr(p, "tp_shard_dim"):
            assert p.numel() * tp == full[name].numel(), (name, p.shape, full[name].shape)
            torch.testing.assert_close(_gather(p.detach(), p.tp_shard_dim, group), full[name])
    assert model.head.lm_head.weight is model.embed.wte.weight  # the tie survives sharding
    assert model.blocks[0].attn.local_heads == CFG["n_head"] // tp

    x, y = batch(0)
    with count_comm() as ledger:
        logits, loss = _tp_loss(model, x, y, group)
        loss.backward()
    ref_logits = ref(x)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), y.flatten())
    ref_loss.backward()
    assert logits.shape[-1] == CFG["vocab_size"] // tp  # the full logits are never gathered
    torch.testing.assert_close(_gather(logits.detach(), -1, group), ref_logits, **TOL)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    grads = _full_grads(model, group)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert ledger.totals() == expected_comm(tp, sp), (what, ledger.totals(), ledger.by_tag())

    # 20 AdamW steps: the loss curve equals the single-process curve.
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    opt_tp = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(STEPS):
        x, y = batch(step)
        _, loss = _tp_loss(model, x, y, group)
        loss.backward()
        ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        for opt in (opt_ref, opt_tp):
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m, s=step: f"step {s}: {m}")
    return ref, model


def _greedy(model, prompt: torch.Tensor, new_tokens: int, group=None) -> list[int]:
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(ids)[:, -1]
            if group is not None:
                logits = _gather(logits, -1, group)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[0].tolist()


PROMPT = torch.tensor([[3, 14, 15, 9, 26]])
MLP_PLAN = {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}


def _check_against_dtensor(rank: int, world_size: int) -> None:
    """Oracle nobody here wrote: torch's DTensor ``parallelize_module`` with Colwise/Rowwise
    on the GPT's MLPs. (The fused attention cannot take DTensor sharding: under DTensor its qkv
    weight reports the global shape, so ``local_heads`` would count every head.) Our
    ``parallelize`` with the same MLP-only plan must give the same loss and every gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from llmlab.parallel.tensor import parallelize

    mesh = init_device_mesh("cpu", (world_size,))
    oracle = parallelize_module(
        make_gpt(),
        mesh,
        {"blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.mlp.proj": RowwiseParallel()},
    )
    ours = parallelize(make_gpt(), MLP_PLAN, dist.group.WORLD)
    x, y = batch(3)
    losses = []
    for model in (oracle, ours):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], **TOL)
    expected = {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for n, p in oracle.named_parameters()
    }
    got = _full_grads(ours, dist.group.WORLD)
    assert set(got) == set(expected)
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _check_dropout_streams(group) -> None:
    """With dropout, the replicated activations (outside TP regions: embedding, residual) must
    stay identical on every rank, so the replicated LayerNorm gradients agree across ranks,
    while attention dropout (inside, on this rank's heads) draws per-rank masks."""
    from llmlab.parallel.tensor import parallelize

    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**CFG, "dropout": 0.2}))
    model = parallelize(model, GPT.tensor_parallel_plan(), group).train()
    torch.manual_seed(5)  # the same default stream on every rank
    x, y = batch(4)
    _, loss = _tp_loss(model, x, y, group)
    loss.backward()
    for name, p in model.named_parameters():
        if not hasattr(p, "tp_shard_dim"):
            g = p.grad.detach().clone()
            rank0 = _gather(g[None], 0, group)[0]
            torch.testing.assert_close(rank0, g, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    state = model.tensor_parallel.rng._states[0]
    states = [torch.empty_like(state) for _ in range(dist.get_world_size(group))]
    dist.all_gather(states, state, group=group)
    assert not torch.equal(states[0], states[1])  # the forked stream differs per rank


def tp2_checks(rank: int, world_size: int, ckpt: str) -> list[int]:
    from llmlab.parallel.checkpoint.consolidated import full_state_dict

    group = dist.group.WORLD
    _check_against_dtensor(rank, world_size)
    _check_dropout_streams(group)
    for sp in (True, False):
        _, model = _check_exact_and_counted(rank, world_size, group, sp)
    # Done-when 5: the consolidated checkpoint of the (trained) tp=2 model, and its greedy decode.
    model.eval()
    state = full_state_dict(model, group)
    if rank == 0:
        torch.save(state, ckpt)
    return _greedy(model, PROMPT, 8, group)


def tp4_and_dp_checks(rank: int, world_size: int) -> tuple[int, list[int], list[int]]:
    from llmlab.parallel import ParallelDims, build_process_groups
    from llmlab.parallel.buffers import all_reduce_mean_
    from llmlab.parallel.checkpoint.consolidated import full_state_dict, load_full_state_dict
    from llmlab.parallel.tensor import parallelize

    world = dist.group.WORLD
    for sp in (False, True):
        _, model = _check_exact_and_counted(rank, world_size, world, sp)

    # DP × TP = 2 × 2: each data replica gets half the batch; the curve equals one process.
    groups = build_process_groups(ParallelDims(data=2, tensor=2))
    dp_rank = groups.coords[0]
    state = full_state_dict(model, world)  # from tp=4 ...
    tp2 = parallelize(make_gpt(), GPT.tensor_parallel_plan(), groups.tensor, sequence_parallel=True)
    load_full_state_dict(tp2, state, groups.tensor)  # ... into tp=2
    plain = make_gpt()
    plain.load_state_dict(state)
    x, _ = batch(0)
    with torch.no_grad():
        torch.testing.assert_close(_gather(tp2(x), -1, groups.tensor), plain(x), **TOL)

    ref, model = make_gpt(), parallelize(make_gpt(), GPT.tensor_parallel_plan(), groups.tensor)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    opt_tp = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(STEPS):
        x, y = batch(step, rows=2 * B)
        rows = slice(dp_rank * B, (dp_rank + 1) * B)
        _, loss = _tp_loss(model, x[rows], y[rows], groups.tensor)
        loss.backward()
        all_reduce_mean_([p.grad for p in model.parameters()], groups.data)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=groups.data)
        ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        for opt in (opt_ref, opt_tp):
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(global_loss / 2, ref_loss, **TOL)
    return dist.get_world_size(groups.tensor), groups.tensor_ranks, groups.data_ranks


@pytest.mark.distributed
def test_gpt_tp2_exact_counted_and_checkpoint_decodes_alike(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "tp2.pt")
    tokens = run_distributed(tp2_checks, 2, ckpt)
    assert tokens[0] == tokens[1]
    plain = make_gpt().eval()
    plain.load_state_dict(torch.load(ckpt))
    assert _greedy(plain, PROMPT, 8) == tokens[0]


@pytest.mark.distributed
def test_gpt_tp4_exact_and_dp2_tp2_curve() -> None:
    out = run_distributed(tp4_and_dp_checks, 4)
    # build_process_groups(data=2, tensor=2) on four ranks: tensor innermost
    assert out[0] == (2, [0, 1], [0, 2])
    assert out[3] == (2, [2, 3], [1, 3])


def test_misconfiguration_names_the_numbers() -> None:
    from llmlab.parallel.tensor import validate_plan

    plan = GPT.tensor_parallel_plan()
    model = GPT(GPTConfig(vocab_size=64, n_head=6, n_embd=48, n_layer=1, block_size=8))
    with pytest.raises(ValueError, match=r"n_head=6 is not divisible by tensor=4"):
        validate_plan(model, plan, 4)
    model = GPT(GPTConfig(vocab_size=66, n_head=4, n_embd=32, n_layer=1, block_size=8))
    with pytest.raises(
        ValueError, match=r"vocabulary size 66 is not divisible by tensor-parallel size 4"
    ):
        validate_plan(model, plan, 4)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 10), torch.nn.Linear(10, 8))
    with pytest.raises(
        ValueError,
        match=r"0: out_features=10 \(hidden size\) is not divisible by tensor-parallel size 4",
    ):
        validate_plan(mlp, {"0": "colwise", "1": "rowwise"}, 4)
    with pytest.raises(ValueError, match="matches no module"):
        validate_plan(mlp, {"fc": "colwise"}, 2)
