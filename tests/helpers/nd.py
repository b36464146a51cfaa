"""The N-D strategy's exactness harness, shared by ``tests/parallel/test_nd.py`` and the
zero-bubble N-D tests: the tiny GPT and Llama configs, the global batches, one rank's ``fit`` in
a real ``Trainer`` (losses and logged grad norms per step), several layouts' fits in one spawn
(``nd_runs``, with the control that skips the data reduction) and the comparisons against the
single-process run.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.helpers.tiny import rank_trainer, tiny_gpt_config, tiny_task, tiny_tokens

MODEL = tiny_gpt_config(n_layer=4, n_head=4, dropout=0.0)
T = 16
STEPS, HALF, BATCH, CLIP = 10, 5, 8, 0.05  # an epoch is HALF batches: resume at its end
TOL = dict(atol=1e-5, rtol=0)


LLAMA = dict(
    arch="llama", vocab_size=64, block_size=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32,
    intermediate_size=96, dropout=0.0,
)  # fmt: skip


def make_task(model: dict = MODEL):
    return tiny_task(model, max_steps=STEPS)


def global_batches(count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL["vocab_size"], (count, BATCH, T + 1), generator=g)


def make_data():
    """The global batches of ``global_batches`` (same generator, same order), HALF an epoch,
    each data-parallel replica reading its rows."""
    return tiny_tokens(HALF, val_batches=1, batch=BATCH, vocab_size=MODEL["vocab_size"], seq=T)


def fit(
    strategy,
    devices: int,
    max_steps: int,
    ckpt_path: str | None = None,
    model: dict = MODEL,
    plugins: list | None = None,
) -> dict:
    import lightning as L
    import torch.distributed as dist

    from llmlab.train.telemetry import TrainingTelemetry

    losses: list[float] = []
    norms: list[float] = []

    class Record(L.Callback):
        """The global loss (a replica's loss averaged over replicas when the task's own step
        returns it) and the logged gradient norm, per step."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"].detach().float().clone()
            s = trainer.strategy
            if devices > 1 and s.dims.pipeline == 1 and s.dims.data > 1:
                dist.all_reduce(loss, group=s.groups.data)
                loss /= s.dims.data
            losses.append(float(loss))
            norms.append(float(trainer.callback_metrics["train/grad_norm"]))

    trainer = rank_trainer(
        strategy,
        devices,
        max_steps,
        gradient_clip_val=CLIP,
        limit_val_batches=1,
        val_check_interval=HALF,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[TrainingTelemetry(peak_flops_per_device=1e12), Record()],
        plugins=plugins,
    )
    task = make_task(model)
    trainer.fit(task, datamodule=make_data(), ckpt_path=ckpt_path)
    return {"trainer": trainer, "losses": losses, "norms": norms}


def nd_runs(rank: int, world: int, root: str, cases: list[dict]) -> dict:
    from llmlab.parallel.strategy import NDParallelStrategy

    class SkipsDataReduction(NDParallelStrategy):
        """The control: tied copies are summed, but every replica steps on its own gradient."""

        def reduce_gradients(self) -> None:
            import torch.distributed as dist

            for p, group in self.parallel.tied:
                dist.all_reduce(p.grad, group=group)

    out = {}
    for case in cases:
        os.environ["WORLD_SIZE"] = str(world)  # Lightning's environment teardown removes it
        cls = SkipsDataReduction if case.get("control") else NDParallelStrategy
        strategy = cls(**case["layout"], timeline_every_n_steps=0)
        ckpt = os.path.join(root, case["resume"]) if case.get("resume") else None
        steps = case.get("steps", STEPS)
        plugins = [case["precision"]()] if case.get("precision") else None
        run = fit(strategy, world, steps, ckpt, case.get("model", MODEL), plugins)
        result = {
            "losses": run["losses"],
            "norms": run["norms"],
            "params": strategy.local_param_count,
            "coords": strategy.groups.coords,
            "comm": dict(strategy.last_comm),
            "chunks": chunk_shapes(strategy, case.get("model", MODEL)["n_layer"]),
            "loss_scale": getattr(
                getattr(run["trainer"].precision_plugin, "masters", None), "loss_scale", None
            ),
        }
        if case.get("save"):
            run["trainer"].save_checkpoint(os.path.join(root, case["save"]))
        out[case["name"]] = result
    return out


def close(got: list[float], want: list[float], what: str, tol: dict = TOL) -> None:
    assert len(got) == len(want), (what, got)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **tol, msg=what)


def check_final_weights(path: Path, reference: dict) -> None:
    from llmlab.models import GPT, GPTConfig

    sd = torch.load(path, weights_only=False)["state_dict"]
    plain = GPT(GPTConfig(**MODEL))
    plain.load_state_dict({k.removeprefix("model."): v for k, v in sd.items()})
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(v, reference["state"][k], **TOL, msg=k)
    # The plain model decodes with those weights: equal logits to the single-process model.
    ref = GPT(GPTConfig(**MODEL))
    ref.load_state_dict(reference["state"])
    x = global_batches(1, 7)[0, :, :-1]
    with torch.no_grad():
        torch.testing.assert_close(plain(x), ref(x), atol=1e-4, rtol=0)


def chunk_shapes(strategy, n_layer: int) -> list[tuple[bool, int, bool]]:
    """(holds the embedding, blocks, holds the head) of each model piece this rank runs: one
    piece without a pipeline, one per virtual stage with one."""
    stage = strategy.parallel.stage
    if stage is None:
        return [(True, n_layer, True)]
    last, local, shapes = n_layer + 1, iter(stage.local_layers), []
    for chunk in stage.chunks:  # pipeline_layers() = [embed, *blocks, head]
        idx = [next(local) for _ in chunk]
        shapes.append((0 in idx, sum(0 < i < last for i in idx), last in idx))
    return shapes
