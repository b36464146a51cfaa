"""``strategy.zero`` in the N-D strategy, inside a real ``lightning.Trainer`` with the real
``CausalLMTask`` (AdamW with two param groups, warmup + cosine, clipping at 1.0, 2 accumulated
batches per step).

Oracles: single-process Lightning training of the same task on the same global batches (loss at
every step within 1e-5, the N-D strategy's bound), and the same layout at ``zero=0`` (within
1e-6: only the summation order of reduce-scatter against all-reduce differs). Layouts: data ×
tensor 2×2 at zero=1, 2, 3, and data × pipeline 2×2 at zero=1 (default); 2×2×2 at zero=1 (slow).
zero=2/3 with a pipeline is refused before any process starts, naming the reason.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import TINY_GPT, rank_trainer, tiny_task, tiny_tokens

STEPS, ACCUMULATE = 20, 2
MAX_STEPS = STEPS // ACCUMULATE  # the data module's 20 batches: 10 optimizer steps


def make_task():
    return tiny_task(max_steps=STEPS)


def make_data():
    return tiny_tokens(STEPS // 2, val_batches=2, batch=8)  # 10 batches an epoch


def fit(strategy, devices: int, root=None, max_steps=MAX_STEPS, ckpt_path=None, save=None):
    import lightning as L

    losses: list[float] = []
    norms: list[float] = []
    memory: list[dict] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"].detach().clone().float()
            if trainer.world_size > 1:  # the global batch's loss: data ranks saw their rows
                import torch.distributed as dist

                dist.all_reduce(loss)  # tensor ranks hold equal values, pipeline ones too
                loss /= trainer.world_size
            losses.append(float(loss))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            norm = getattr(trainer.strategy, "global_grad_norm", None)
            if norm is not None:
                norms.append(float(norm(optimizer)))

    trainer = rank_trainer(
        strategy,
        devices,
        max_steps,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=1.0,
        limit_val_batches=2,
        val_check_interval=10,
        check_val_every_n_epoch=None,
        default_root_dir=root,
        callbacks=[Record()],
    )
    task = make_task()
    trainer.fit(task, datamodule=make_data(), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    last = getattr(trainer.strategy, "last_comm", {})
    memory.append({k: v for k, v in last.items() if k.startswith("memory/")})
    return losses, norms, memory[0]


def _runs(rank: int, world: int, root: str, cases: list[tuple[str, dict]]) -> dict:
    from llmlab.parallel.strategy import NDParallelStrategy

    out = {}
    for name, kwargs in cases:
        os.environ["WORLD_SIZE"] = str(world)  # Lightning's environment teardown removes it
        if "resume" in kwargs:  # half the steps in one layout, the rest in another
            first, second = kwargs["resume"]
            path = os.path.join(root, f"{name}.ckpt")
            half = MAX_STEPS // 2
            losses, *_ = fit(NDParallelStrategy(**first, timeline_every_n_steps=0), world, root,
                             max_steps=half, save=path)  # fmt: skip
            os.environ["WORLD_SIZE"] = str(world)
            more, *_ = fit(NDParallelStrategy(**second, timeline_every_n_steps=0), world, root,
                           ckpt_path=path)  # fmt: skip
            out[name] = {"losses": losses + more, "checkpoint": path}
            continue
        losses, norms, memory = fit(NDParallelStrategy(**kwargs, timeline_every_n_steps=0), world,
                                    root)  # fmt: skip
        out[name] = {"losses": losses, "norms": norms, "memory": memory}
    return out


@pytest.fixture(scope="module")
def single_process():
    import lightning as L

    L.seed_everything(0)
    return fit("auto", 1)[0]


def check(results: list[dict], reference: list[float], layouts: list[str], stages) -> None:
    assert len(reference) == STEPS
    for rank, by_case in enumerate(results):
        for layout in layouts:
            base = by_case[f"{layout} zero=0"]
            for stage in stages:
                r = by_case[f"{layout} zero={stage}"]
                case = f"rank {rank} {layout} zero={stage}"
                assert len(r["losses"]) == STEPS, case
                assert max(abs(a - b) for a, b in zip(r["losses"], reference)) <= 1e-5, case
                assert max(abs(a - b) for a, b in zip(r["losses"], base["losses"])) <= 1e-6, case
                assert max(abs(a - b) / b for a, b in zip(r["norms"], base["norms"])) <= 1e-6
                assert r["memory"]["memory/optim_bytes"] > 0, case  # logged by the strategy


@pytest.mark.distributed
def test_zero_with_tensor_and_pipeline_parallel(tmp_path, single_process) -> None:
    cases = [(f"dp2xtp2 zero={z}", dict(tensor=2, zero=z)) for z in (0, 1, 2, 3)]
    cases += [(f"dp2xpp2 zero={z}", dict(pipeline=2, microbatches=2, zero=z)) for z in (0, 1)]
    resume = dict(resume=(dict(tensor=2, zero=1), dict(tensor=1, zero=3)))
    cases += [("dp2xtp2 zero=1 -> dp4 zero=3", resume)]
    results = run_distributed(_runs, 4, str(tmp_path), cases, timeout=900)
    check(results, single_process, ["dp2xtp2"], (1, 2, 3))
    check(results, single_process, ["dp2xpp2"], (1,))
    for r in results:  # ZeRO-3 keeps half of what this rank's tensor shard holds (dp=2)
        z1, z3 = r["dp2xtp2 zero=1"]["memory"], r["dp2xtp2 zero=3"]["memory"]
        assert z3["memory/params_bytes"] * 2 <= z1["memory/params_bytes"] + 64
    # the checkpoint of a 2x2 ZeRO-1 run resumes at data 4 with ZeRO-3 on the same curve...
    resumed = results[0]["dp2xtp2 zero=1 -> dp4 zero=3"]
    assert len(resumed["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(resumed["losses"], single_process)) <= 1e-5
    # ... and is one consolidated file that a plain GPT loads
    import torch

    from llmlab.models import GPT, GPTConfig

    state = torch.load(resumed["checkpoint"], weights_only=False)["state_dict"]
    plain = GPT(GPTConfig(**TINY_GPT))
    plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})


@pytest.mark.slow
@pytest.mark.distributed
def test_zero1_in_3d(tmp_path, single_process) -> None:
    layout = dict(pipeline=2, tensor=2, microbatches=2)
    cases = [(f"2x2x2 zero={z}", dict(layout, zero=z)) for z in (0, 1)]
    results = run_distributed(_runs, 8, str(tmp_path), cases, timeout=1800)
    check(results, single_process, ["2x2x2"], (1,))


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_2_and_3_with_a_pipeline_are_refused_with_the_reason(zero) -> None:
    from llmlab.parallel.strategy import NDParallelStrategy

    with pytest.raises(ValueError, match=rf"zero={zero} with strategy.pipeline=2 is refused.*"
                                         r"DeepSpeed refuses"):  # fmt: skip
        NDParallelStrategy(pipeline=2, zero=zero)


def test_zero_stage_is_checked() -> None:
    from llmlab.parallel.strategy import NDParallelStrategy

    with pytest.raises(ValueError, match=r"strategy.zero must be one of \(0, 1, 2, 3\), got 4"):
        NDParallelStrategy(zero=4)
