"""Split backward in one process: B then W equals one ``backward``, and what composes with it.

Oracle: ``torch.autograd.backward`` of the same graph (the input's gradient and every weight's),
on a GPT block stage, a Llama block stage and a weight used twice on the input path. Then the
engine itself on a one-rank V (two chunks on one rank, the V's turn through the local mailbox,
no process group): the loss-scaling path (a precision plugin's scale reaches B *and* W) and
activation checkpointing (recomputed once per micro-batch and block, shared by B and W).
Tolerance: fp32, 1e-6 absolute and relative unless stated.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from llmlab.models import Llama, LlamaConfig
from llmlab.parallel.pipeline.engine import PipelineEngine
from llmlab.parallel.pipeline.recompute import share_recompute
from llmlab.parallel.pipeline.split_backward import backward_input, backward_weight
from llmlab.parallel.pipeline.stage import cut_stage
from llmlab.parallel.precision.master import MasterWeights
from llmlab.parallel.precision.scaler import DynamicLossScaler
from tests.helpers.tiny import lm_loss, tiny_gpt, token_batch

TOL = dict(atol=1e-6, rtol=1e-6)
LLAMA = dict(
    vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
    intermediate_size=48,
)  # fmt: skip


def tiny_llama(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig(**{**LLAMA, **overrides}))


def _stage_after_embedding(model: nn.Module) -> tuple[nn.Sequential, torch.Tensor]:
    """Everything after the embedding as one stage, and its (differentiable) input."""
    layers = model.pipeline_layers()
    x, _ = token_batch()
    with torch.no_grad():
        h = layers[0](x)
    return nn.Sequential(*layers[1:]), h


@pytest.mark.parametrize("make", [tiny_gpt, tiny_llama], ids=["gpt", "llama"])
def test_b_then_w_equals_one_backward(make):
    _, y = token_batch()
    stage, h = _stage_after_embedding(make())
    twin = copy.deepcopy(stage)

    x_ref = h.clone().requires_grad_(True)
    lm_loss(stage(x_ref), y).backward()

    x = h.clone().requires_grad_(True)
    params = list(twin.parameters())
    grad_x, deferred = backward_input(lm_loss(twin(x), y), None, x, params)
    assert all(p.grad is None for p in params), "B must leave the weight gradients to W"
    assert len(deferred.groups) > 1  # one per weight's branch point, not one big call
    torch.testing.assert_close(grad_x, x_ref.grad, **TOL)
    backward_weight(deferred)
    for (name, p), q in zip(stage.named_parameters(), params, strict=True):
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=name)


def test_w_runs_gradient_hooks_as_one_backward_does():
    """W accumulates through autograd, so the hooks data parallelism hangs on parameters fire
    as under a plain ``backward``: each post-accumulate hook once per parameter (bucketed DP and
    ZeRO reduce from it), with the final ``.grad`` in place, and tensor hooks (sequence
    parallelism's all-reduce) on the gradient before it is accumulated."""
    _, y = token_batch()
    stage, h = _stage_after_embedding(tiny_gpt())
    twin = copy.deepcopy(stage)
    x_ref = h.clone().requires_grad_(True)
    lm_loss(stage(x_ref), y).backward()

    params = list(twin.parameters())
    seen: dict[int, list[torch.Tensor]] = {id(p): [] for p in params}
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: seen[id(q)].append(q.grad.clone()))
        p.register_hook(lambda g: g * 2)  # a tensor hook that changes the gradient
    x = h.clone().requires_grad_(True)
    _, deferred = backward_input(lm_loss(twin(x), y), None, x, params)
    assert all(not hits for hits in seen.values()), "B accumulates no weight gradient"
    backward_weight(deferred)
    for (name, p), q in zip(stage.named_parameters(), params, strict=True):
        assert len(seen[id(q)]) == 1, name
        torch.testing.assert_close(seen[id(q)][0], 2 * p.grad, **TOL, msg=name)
        torch.testing.assert_close(q.grad, 2 * p.grad, **TOL, msg=name)


class _SharedTwice(nn.Module):
    """``(x·W)·W + b``: one weight at two branch points on the input path, one after the
    other, so W must not count the upstream one's contribution twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight) @ self.weight + self.bias


def test_weight_used_twice_on_the_input_path():
    ref, split = _SharedTwice(), _SharedTwice()
    x0 = torch.randn(4, 8)
    g = torch.randn(4, 8)
    x_ref = x0.clone().requires_grad_(True)
    ref(x_ref).backward(g)
    x = x0.clone().requires_grad_(True)
    grad_x, deferred = backward_input(split(x), g, x, list(split.parameters()))
    backward_weight(deferred)
    torch.testing.assert_close(grad_x, x_ref.grad, **TOL)
    torch.testing.assert_close(split.weight.grad, ref.weight.grad, **TOL)
    torch.testing.assert_close(split.bias.grad, ref.bias.grad, **TOL)


def test_no_input_path_defers_the_whole_backward():
    """A first stage (token ids in): B has nothing to compute; W is the whole backward."""
    model, ref = tiny_gpt(), tiny_gpt()
    x, y = token_batch()
    lm_loss(ref(x), y).backward()
    grad_x, deferred = backward_input(lm_loss(model(x), y), None, x, list(model.parameters()))
    assert grad_x is None and deferred.whole is not None
    assert all(p.grad is None for p in model.parameters())
    backward_weight(deferred)
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=name)


# ------------------------------------------------------------- the engine on a one-rank V


def _one_rank_v(model: nn.Module, **engine_kwargs) -> PipelineEngine:
    """Both chunks of a V on one rank: chunk 0 = [embed, block0], chunk 1 = [block1, head]."""
    mods = cut_stage(model.pipeline_layers(), 1, 0, virtual_stages=2, placement="v")
    return PipelineEngine(mods.chunks, 0, 1, loss_fn=lm_loss, **engine_kwargs)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_one_rank_v_matches_one_backward(name):
    x, y = token_batch()
    ref, model = tiny_llama(), tiny_llama()
    lm_loss(ref(x), y).backward()
    result = _one_rank_v(model).train_step(x, y, 4, name)
    torch.testing.assert_close(result.loss, lm_loss(ref(x), y).detach(), **TOL)
    for (n, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=n)


def test_loss_scale_reaches_b_and_w():
    """The engine's ``scale_loss`` (a precision plugin's ``scale_loss``) multiplies the loss
    whose graph both B and W differentiate. A power of two scales every gradient exactly, so
    a W that missed the scale would be off by 2**10, not by rounding."""
    x, y = token_batch()
    plain, scaled = tiny_gpt(), tiny_gpt()
    _one_rank_v(plain).train_step(x, y, 4, "zbv")
    _one_rank_v(scaled, scale_loss=lambda t: t * 1024.0).train_step(x, y, 4, "zbv")
    for (n, p), q in zip(plain.named_parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad * 1024.0, atol=0, rtol=0, msg=n)


def test_fp16_master_weights_scaling_through_split_backward():
    """fp16 model, fp32 masters, dynamic loss scale 2**12 (the fp16 plugin's machinery,
    ``MasterWeights``): unscaled gradients after ZB-V equal those after whole backwards (1F1B
    on the same one-rank pipeline, interleaved placement): the same fp16 kernels run, split or
    not (tolerance 1e-6 relative on the fp32 unscaled gradients); and the scale was needed:
    without it fp16 gradients underflow to zero somewhere."""

    def run(schedule: str, scale: float, placement: str) -> list[torch.Tensor]:
        model = tiny_gpt().half()
        masters = MasterWeights(model.parameters(), DynamicLossScaler(init_scale=scale))
        mods = cut_stage(model.pipeline_layers(), 1, 0, 2, placement=placement)
        loss = lambda out, t: lm_loss(out.float(), t)  # noqa: E731
        engine = PipelineEngine(mods.chunks, 0, 1, loss_fn=loss, scale_loss=masters.scale_loss)
        engine.train_step(*token_batch(), 4, schedule)
        assert not masters.unscale()  # no overflow
        return [m.grad for m in masters.masters]

    split = run("zbv", 2.0**12, "v")
    whole = run("interleaved", 2.0**12, "loop")
    for a, b in zip(split, whole, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=1e-6)
    unscaled = run("zbv", 1.0, "v")
    assert sum(int((g == 0).sum()) for g in unscaled) > sum(int((g == 0).sum()) for g in split)


def _count_forwards(blocks: list[nn.Module]) -> list[int]:
    calls = [0]
    for block in blocks:
        forward = block.forward

        def counted(self, *args, _forward=forward, **kwargs):
            calls[0] += 1
            return _forward(*args, **kwargs)

        block.forward = types.MethodType(counted, block)
    return calls


def test_checkpointed_blocks_recompute_once_for_b_and_w():
    """Each checkpointed block runs forward twice per micro-batch (forward, one recompute)
    under ZB-V, as under a whole backward; gradients equal the unwrapped model's."""
    x, y = token_batch()
    ref, model = tiny_gpt(), tiny_gpt()
    lm_loss(ref(x), y).backward()
    calls = _count_forwards(list(model.blocks))
    for i, block in enumerate(list(model.blocks)):
        model.blocks[i] = checkpoint_wrapper(block)
    engine = _one_rank_v(model)
    with pytest.raises(ValueError, match="share_recompute"):
        engine.train_step(x, y, 4, "zbv")  # PyTorch's checkpoint: once per autograd call
    model.zero_grad(set_to_none=True)
    calls[0] = 0
    assert sum(share_recompute(chunk) for chunk in engine.chunks) == 2
    engine.train_step(x, y, 4, "zbv")
    assert calls[0] == 2 * 2 * 4  # blocks × (forward + recompute) × micro-batches
    for (n, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=n)


def test_split_schedules_refuse_compiled_blocks():
    """A compiled block's backward is one node computing both gradients: W would redo it, so
    the engine refuses, as torch's split schedules do (nothing is compiled: the check reads the
    module, before any step)."""
    model = tiny_gpt()
    model.blocks[1].compile()
    with pytest.raises(ValueError, match="cannot run compiled modules"):
        _one_rank_v(model).train_step(*token_batch(), 4, "zbv")


def test_shared_recompute_replays_dropout():
    """Recompute must see the forward's random numbers (RNG state restored)."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    twin = copy.deepcopy(layer)
    wrapped = checkpoint_wrapper(twin)
    share_recompute(wrapped)
    x = torch.randn(16, 8)
    torch.manual_seed(5)
    layer(x).sum().backward()
    torch.manual_seed(5)
    x2 = x.clone().requires_grad_(True)
    _, deferred = backward_input(wrapped(x2).sum(), None, x2, list(twin.parameters()))
    backward_weight(deferred)
    for p, q in zip(layer.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, **TOL)
