"""A tiny GPT trained by a plain loop, on one process or on data ranks under a ``ZeroEngine``.

The optimizer is the task's own (``llmlab.train.task.adamw_warmup_cosine``: AdamW with a decay and
a no-decay param group, warmup + cosine ``LambdaLR``), gradients are clipped by the global norm at
``MAX_NORM`` (low enough that it clips), and every optimizer step accumulates ``ACCUMULATE``
micro-batches. Every rank cuts its rows from the same global micro-batch, so one process on the
global batch is the oracle.

``tests/parallel/data/test_zero*.py`` and ``benchmarks/zero.py`` share it; it lives here because
benchmarks never import ``tests`` (``tests/test_import_boundaries.py``).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.utilities.data import AttributeDict

from llmlab.models import GPT, GPTConfig
from llmlab.parallel.checkpoint.zero_state import zero_full_params
from llmlab.train.task import adamw_warmup_cosine

STEPS = 20
ACCUMULATE = 2
GLOBAL_ROWS = 8  # sequences per micro-batch, over all ranks
SEQ = 16
MAX_NORM = 0.3
# The task's own hparams type (attributes and ``.get``, as ``adamw_warmup_cosine`` reads them).
HP = AttributeDict(
    lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup_steps=4, max_steps=STEPS,
    min_lr_ratio=0.1,
)  # fmt: skip


def tiny_gpt(seed: int = 0, n_layer: int = 3) -> GPT:
    """``bias=False``: the attention *key* bias has an identically zero gradient (softmax ignores
    a constant added to every score of a row), so its gradient is pure rounding noise, which AdamW
    normalises into steps of about ±lr -- no two summation orders (DDP against one process
    included) agree on it. Without biases every compared weight has a real gradient."""
    torch.manual_seed(seed)
    return GPT(
        GPTConfig(vocab_size=64, block_size=SEQ, n_layer=n_layer, n_head=2, n_embd=32, bias=False)
    )


def micro_batch(step: int, micro: int, rank: int = 0, world: int = 1) -> tuple:
    """This rank's rows of global micro-batch (step, micro): inputs and next-token targets."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, 64, (GLOBAL_ROWS, SEQ + 1), generator=g)
    rows = GLOBAL_ROWS // world
    mine = tokens[rank * rows : (rank + 1) * rows]
    return mine[:, :-1], mine[:, 1:]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def optimizer_for(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    cfg = adamw_warmup_cosine(model, HP)
    return cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]


def train_single(steps: int = STEPS, n_layer: int = 3) -> dict[str, Any]:
    """The oracle: one process, the whole global batch, torch's clip_grad_norm_."""
    model = tiny_gpt(n_layer=n_layer)
    opt, sched = optimizer_for(model)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(ACCUMULATE):
            loss = loss_of(model, *micro_batch(step, micro)) / ACCUMULATE
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        sched.step()
        losses.append(total)
    return {
        "losses": losses,
        "norms": norms,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def train_zero(
    engine_factory: Any,
    rank: int,
    world: int,
    steps: int = STEPS,
    n_layer: int = 3,
    start: int = 0,
    model: GPT | None = None,
    engine: Any = None,
    opt: Any = None,
    sched: Any = None,
    after_backward: Any = None,
) -> dict[str, Any]:
    """Train on this rank's rows with ``engine_factory(model)``; losses are global means.
    ``after_backward(model, engine, opt)`` runs once the gradients are reduced, before clipping."""
    if model is None:
        model = tiny_gpt(seed=0 if rank == 0 else 100 + rank, n_layer=n_layer)  # rank 0 wins
        engine = engine_factory(model)
        opt, sched = optimizer_for(model)
        engine.rewire(opt)
    losses, norms = [], []
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for micro in range(ACCUMULATE):
            last = micro == ACCUMULATE - 1
            with nullcontext() if last else engine.no_sync():
                loss = loss_of(model, *micro_batch(step, micro, rank, world)) / ACCUMULATE
                loss.backward()
            total += loss.detach()
        if after_backward is not None:
            after_backward(model, engine, opt)
        norms.append(engine.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        sched.step()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return {
        "losses": losses,
        "norms": norms,
        "params": zero_full_params(engine),
        "memory": engine.memory_stats(),
        "state": (model, engine, opt, sched),
    }


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def curve_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b)) if a else math.inf
