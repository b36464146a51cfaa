"""GPT and Llama with the sequence split across 2 gloo ranks, against the same model unsplit.

Ring attention enters through the models' ``swap_attention`` door (``ContextParallel.apply``),
positions through their ``positions`` argument (given, or filled in by ``apply``'s hook), the
loss through ``sequence_loss_share`` and the gradients through ``reduce_context_gradients``.
Oracle: the unsplit module or model in one process (fp32, same seed), its loss
``F.cross_entropy`` over the whole sequence. Tolerance 1e-5 on outputs, input gradients,
parameter gradients, logits and loss. Controls: skipping the context-group gradient reduction
must leave gradients off by more than 1e-3; the bytes sent must equal ``cp_bytes`` for the
model's layers (twice the forward's under activation checkpointing); a KV cache or an attention
mask is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmlab.models import GPT, GPTConfig, Llama, LlamaConfig
from llmlab.parallel.context import ContextParallel, cp_bytes
from llmlab.parallel.memory import apply_activation_checkpointing
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import tiny_gpt_config

pytestmark = pytest.mark.distributed

TOL = 1e-5
B, T = 2, 16
LLAMA = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
             intermediate_size=64)  # fmt: skip


def _build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(**tiny_gpt_config(n_head=4, dropout=0.0)))
    return Llama(LlamaConfig(**LLAMA))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _check_attention_module(kind: str, scheme: str, failures: list[str]) -> None:
    """One attention module: forward, input gradient, parameter gradients after reduction."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, 32, generator=g)
    dy = torch.randn(B, T, 32, generator=g)
    ref_model, model = _build(kind), _build(kind)
    ref_attn = ref_model.blocks[0].attn
    cp = ContextParallel(scheme=scheme)
    changed = cp.apply(model)
    attn = model.blocks[0].attn

    x_ref = x.clone().requires_grad_()
    extra = () if kind == "gpt" else (torch.arange(T).unsqueeze(0),)
    y_ref = ref_attn(x_ref, *extra)
    y_ref.backward(dy)

    x_mine = cp.shard(x).requires_grad_()
    extra = () if kind == "gpt" else (cp.positions(T),)  # RoPE at the tokens' global positions
    y = attn(x_mine, *extra)
    y.backward(cp.shard(dy))
    cp.reduce_gradients(attn)
    tag = f"{kind} attention ({scheme})"
    if changed != len(model.blocks):
        failures.append(f"{tag}: swap_attention changed {changed} modules")
    for name, ours, theirs in (("output", y, y_ref), ("input grad", x_mine.grad, x_ref.grad)):
        if (d := _max_diff(ours.detach(), cp.shard(theirs.detach()))) > TOL:
            failures.append(f"{tag}: {name} differs by {d:.3g}")
    ref_grads = _grads(ref_attn)
    for name, grad in _grads(attn).items():
        if (d := _max_diff(grad, ref_grads[name])) > TOL:
            failures.append(f"{tag}: grad of {name} differs by {d:.3g}")


def _check_model(kind: str, scheme: str, failures: list[str]) -> None:
    """The whole model: logits, loss over the whole sequence, every gradient, cp_bytes; and
    the controls (no reduction fails; the folded form is the same)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (B, T), generator=g)
    targets = torch.randint(0, 64, (B, T), generator=g)
    targets[0, :5] = -100  # ignored tokens, unevenly spread over the ranks
    ref = _build(kind)
    ref_logits = ref(ids)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref_loss.backward()
    ref_grads = _grads(ref)

    tag = f"{kind} model ({scheme})"
    grads_by_form = {}
    for form, scale, op in (("sum", 1.0, "sum"), ("folded", None, "mean")):
        model = _build(kind)
        cp = ContextParallel(scheme=scheme)
        cp.apply(model)
        if form == "sum":  # positions filled in by apply's hook, as a task calling model(x)
            logits = model(cp.shard(ids))
        else:
            logits = model(cp.shard(ids), positions=cp.positions(T))
        share = cp.loss_share(logits, cp.shard(targets), scale=scale or cp.degree)
        share.backward()
        if form == "sum":
            loss = share.detach().clone()
            dist.all_reduce(loss)
            if (d := abs(loss.item() - ref_loss.item())) > TOL:
                failures.append(f"{tag}: summed loss shares differ from the loss by {d:.3g}")
            if (d := _max_diff(cp.gather(logits), ref_logits.detach())) > TOL:
                failures.append(f"{tag}: gathered logits differ by {d:.3g}")
            c = model.config
            want = cp_bytes(B, getattr(c, "n_kv_head", c.n_head), T, c.n_embd // c.n_head,
                            cp.degree, torch.float32, layers=c.n_layer)  # fmt: skip
            if cp.stats.bytes_sent != want:
                failures.append(f"{tag}: sent {cp.stats.bytes_sent} bytes, cp_bytes {want}")
            refused = {"attention": model.new_cache(B, T), "attention_mask": torch.ones(B, T)}
            for name, value in refused.items():
                try:
                    model(cp.shard(ids), **{name: value})
                    failures.append(f"{tag}: {name} not refused")
                except ValueError as err:
                    if "runs whole training sequences only" not in str(err):
                        failures.append(f"{tag}: {name} refused with {err!r}")
            unreduced = max(_max_diff(gr, ref_grads[n]) for n, gr in _grads(model).items())
            if unreduced < 1e-3:  # the control: without the reduction the step would be wrong
                failures.append(f"{tag}: gradients already match without the reduction")
        cp.reduce_gradients(model, op=op)
        grads_by_form[form] = _grads(model)
    for form, grads in grads_by_form.items():
        for name, grad in grads.items():
            if (d := _max_diff(grad, ref_grads[name])) > TOL:
                failures.append(f"{tag}, {form} reduction: grad of {name} differs by {d:.3g}")


def _check_checkpointed_bytes(failures: list[str]) -> None:
    """Activation checkpointing re-runs each block's forward: its key/value chunks travel again."""
    model = _build("gpt")
    cp = ContextParallel()
    cp.apply(model)
    apply_activation_checkpointing(model)
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(3))
    model(cp.shard(ids)).sum().backward()
    c = model.config
    want = cp_bytes(B, c.n_head, T, c.n_embd // c.n_head, cp.degree, torch.float32,
                    layers=c.n_layer, forwards=2)  # fmt: skip
    if cp.stats.bytes_sent != want:
        failures.append(f"checkpointed GPT: sent {cp.stats.bytes_sent} bytes, cp_bytes {want}")


def check_models(rank: int, world: int) -> list[str]:
    failures: list[str] = []
    for kind in ("gpt", "llama"):
        _check_attention_module(kind, "zigzag", failures)
    _check_model("gpt", "zigzag", failures)
    _check_model("llama", "zigzag", failures)
    _check_model("llama", "contiguous", failures)
    _check_checkpointed_bytes(failures)
    return failures


def test_gpt_and_llama_split_over_two_ranks_equal_the_unsplit_model():
    failures = [f for rank in run_distributed(check_models, 2) for f in rank]
    assert not failures, "\n".join(failures)
