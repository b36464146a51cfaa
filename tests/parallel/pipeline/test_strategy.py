"""``PipelineStrategy`` inside a real ``lightning.Trainer``: same loss curve as ``strategy=auto``.

How ranks are launched: with ``run_distributed`` (gloo, ``LOCAL_RANK`` set), each rank builds its
own ``Trainer``; Lightning sees an externally created process group (``LightningEnvironment``
with ``LOCAL_RANK``) and does not re-run ``sys.argv``, which under pytest would re-run pytest.
This keeps several fits (and their checkpoints) in one spawn. The reference (``strategy=auto``)
runs in the test process. Oracle: single-process Lightning training of the same task on the same
batches; tolerance 1e-5 on every step's loss (the issue's bound; fp32).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import (
    TINY_GPT,
    loss_recorder,
    quiet_trainer,
    rank_trainer,
    tiny_task,
    tiny_tokens,
)

MODEL = TINY_GPT
STEPS, BATCH = 20, 8


def make_task():
    return tiny_task(MODEL, max_steps=STEPS)


def make_data():
    # 10 batches an epoch: the resume test's checkpoint at step 10 ends an epoch, so Lightning
    # resumes at the next batch (a plain DataLoader cannot resume mid-epoch)
    return tiny_tokens(STEPS // 2, val_batches=2, batch=BATCH)


def fit(strategy, devices: int, max_steps: int = STEPS, ckpt_path=None, root=None):
    losses: list[float] = []

    trainer = rank_trainer(
        strategy,
        devices,
        max_steps,
        gradient_clip_val=1.0,
        limit_val_batches=2,
        val_check_interval=10,
        check_val_every_n_epoch=None,
        default_root_dir=root,
        callbacks=[loss_recorder(losses)],
    )
    task = make_task()
    trainer.fit(task, datamodule=make_data(), ckpt_path=ckpt_path)
    return trainer, task, losses


def _pipeline_runs(rank: int, world: int, root: str, cases: list[dict]):
    from llmlab.parallel.presets import PipelineStrategy

    out = {}
    for case in cases:
        os.environ["WORLD_SIZE"] = str(world)  # Lightning's environment teardown removes it
        kind = case["kind"]
        strategy = PipelineStrategy(**case["strategy"], timeline_every_n_steps=5)
        if kind == "fit":
            trainer, _, losses = fit(strategy, world, root=root)
            out[case["name"]] = {
                "losses": losses,
                "params": strategy.local_param_count,
                "bubble": strategy.last_bubble,
                "val": float(trainer.callback_metrics["val/loss"]),
            }
            if case.get("save"):
                trainer.save_checkpoint(os.path.join(root, case["save"]))
        elif kind == "resume":  # 10 steps, checkpoint, then a new Trainer continues to 20
            trainer, _, first = fit(strategy, world, max_steps=10, root=root)
            path = os.path.join(root, f"half-{case['name']}.ckpt")
            trainer.save_checkpoint(path)
            os.environ["WORLD_SIZE"] = str(world)
            strategy = PipelineStrategy(**case["strategy"], timeline_every_n_steps=0)
            _, _, second = fit(strategy, world, ckpt_path=path, root=root)
            out[case["name"]] = {"losses": first + second}
        elif kind == "validate":  # load a checkpoint from another layout, evaluate
            trainer = quiet_trainer(devices=world, strategy=strategy, limit_val_batches=2)
            metrics = trainer.validate(
                make_task(), datamodule=make_data(), ckpt_path=os.path.join(root, case["ckpt"])
            )
            out[case["name"]] = {
                "val": metrics[0]["val/loss"],
                "params": strategy.local_param_count,
            }
    return out


@pytest.fixture(scope="module")
def reference():
    trainer, _, losses = fit("auto", 1)
    return {"losses": losses, "val": float(trainer.callback_metrics["val/loss"])}


@pytest.mark.distributed
def test_pp2_loss_curve_checkpoint_and_resume(reference, tmp_path):
    cases = [
        {
            "kind": "fit",
            "name": "1f1b",
            "strategy": dict(stages=2, microbatches=4),
            "save": "pp2.ckpt",
        },
        {
            "kind": "fit",
            "name": "gpipe",
            "strategy": dict(stages=2, microbatches=2, schedule="gpipe"),
        },
        {"kind": "resume", "name": "resume", "strategy": dict(stages=2, microbatches=4)},
    ]
    results = run_distributed(_pipeline_runs, 2, str(tmp_path), cases, timeout=900)
    ref = torch.tensor(reference["losses"])
    for name in ("1f1b", "gpipe", "resume"):
        got = torch.tensor(results[0][name]["losses"])
        assert len(got) == STEPS
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0, msg=f"{name}: {got} vs {ref}")
        assert results[0][name]["losses"] == results[1][name]["losses"]  # logged on every rank
    # validation runs forward-only through the pipeline and matches too
    assert results[0]["1f1b"]["val"] == pytest.approx(reference["val"], abs=1e-5)
    # each rank holds only its stage: the two shares add up to the model plus the tied copy
    from llmlab.models import GPT, GPTConfig

    total = sum(p.numel() for p in GPT(GPTConfig(**MODEL)).parameters())
    shares = [r["1f1b"]["params"] for r in results]
    assert max(shares) < total and sum(shares) == total + 64 * 32
    assert 0.0 < results[0]["1f1b"]["bubble"] < 1.0

    # the consolidated checkpoint loads into a plain GPT for decoding
    ckpt = torch.load(tmp_path / "pp2.ckpt", weights_only=False)
    model = GPT(GPTConfig(**MODEL))
    model.load_state_dict({k[len("model.") :]: v for k, v in ckpt["state_dict"].items()})
    ids = torch.zeros(1, 1, dtype=torch.long)
    for _ in range(4):
        ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    assert ids.shape == (1, 5)


@pytest.mark.distributed
@pytest.mark.slow  # 4 processes, two Trainers: the 2-rank test above covers the default suite
def test_dp2_pp2_and_checkpoint_into_pp4(reference, tmp_path):
    cases = [
        {
            "kind": "fit",
            "name": "dp2pp2",
            "strategy": dict(stages=2, microbatches=2),
            "save": "dp2pp2.ckpt",
        },
        {
            "kind": "validate",
            "name": "pp4",
            "strategy": dict(stages=4, microbatches=2),
            "ckpt": "dp2pp2.ckpt",
        },
    ]
    results = run_distributed(_pipeline_runs, 4, str(tmp_path), cases, timeout=900)
    got = torch.tensor(results[0]["dp2pp2"]["losses"])
    torch.testing.assert_close(got, torch.tensor(reference["losses"]), atol=1e-5, rtol=0)
    assert results[0]["pp4"]["val"] == pytest.approx(reference["val"], abs=1e-5)
    assert len({r["pp4"]["params"] for r in results}) > 1  # really split four ways
