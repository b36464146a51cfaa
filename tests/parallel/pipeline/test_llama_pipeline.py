"""The Llama through ``PipelineStrategy`` (2 stages, 1F1B, 4 micro-batches) in a real ``Trainer``.

Oracle: the same ``CausalLMTask`` trained by a raw single-process loop on the same batches
(AdamW, warmup + cosine, clipping at 1.0, as Lightning's automatic optimization does), fp32:
every step's loss and every gradient of the last step within atol 1e-5. The stages are cut from
``[embed, block0, block1, head]``; RoPE positions are not passed between stages (each block
takes 0..T-1 itself), which is what this checks. The consolidated checkpoint then goes through
``llmlab.train.sample.load_checkpoint``, which must rebuild a ``Llama`` from the checkpoint's
own config (``arch: llama``) and decode.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import loss_recorder, rank_trainer, tiny_task, token_batch

MODEL = dict(
    arch="llama", vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
    intermediate_size=48,
)  # fmt: skip
STEPS, BATCH, T = 4, 8, 12
TASK = dict(lr=1e-2, warmup_steps=2, max_steps=STEPS)
TOL = dict(atol=1e-5, rtol=0)


def make_task():
    return tiny_task(MODEL, seed_all=False, **TASK)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(BATCH, seed=300 + step, vocab_size=MODEL["vocab_size"], seq=T)


def pipeline_run(rank: int, world_size: int, ckpt: str) -> dict:
    from llmlab.parallel.presets import PipelineStrategy

    os.environ["WORLD_SIZE"] = str(world_size)
    losses: list[float] = []

    strategy = PipelineStrategy(stages=2, microbatches=4, schedule="1f1b", timeline_every_n_steps=0)
    trainer = rank_trainer(
        strategy,
        world_size,
        STEPS,
        gradient_clip_val=1.0,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[loss_recorder(losses)],
    )
    task = make_task()
    loader = torch.utils.data.DataLoader([batch(s) for s in range(STEPS)], batch_size=None)
    trainer.fit(task, train_dataloaders=loader)
    held = {n: p.grad.clone() for n, p in task.model.named_parameters() if not p.is_meta}
    trainer.save_checkpoint(ckpt)
    return {"losses": losses, "grads": held, "params": strategy.local_param_count}


def reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Losses, the last step's (clipped) gradients and the final weights of a raw loop."""
    task = make_task()
    opt_cfg = task.configure_optimizers()
    opt, sched = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = task.loss_fn(task.model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(task.model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    grads = {n: p.grad.clone() for n, p in task.model.named_parameters()}
    return losses, grads, task.model.state_dict()


@pytest.mark.distributed
def test_llama_pp2_1f1b_equals_single_process_and_its_checkpoint_samples(tmp_path) -> None:
    from llmlab.decoding import generate
    from llmlab.train.sample import load_checkpoint

    ckpt = str(tmp_path / "pp2.ckpt")
    results = run_distributed(pipeline_run, 2, ckpt, timeout=900)
    losses, grads, weights = reference()
    for r in results:  # the loss is logged on every rank
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), **TOL)
    # Each rank held only its stage; together, every parameter once, with its gradient.
    held = [set(r["grads"]) for r in results]
    assert held[0] and held[1] and not held[0] & held[1]
    assert held[0] | held[1] == set(grads)
    for r in results:
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")

    model, _ = load_checkpoint(ckpt)  # rebuilt from the checkpoint's own config
    assert type(model).__name__ == "Llama" and model.config.n_kv_head == 2
    for name, w in model.state_dict().items():
        torch.testing.assert_close(w, weights[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    out = generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=5)
    assert out.shape == (1, 8)
