"""Sharded checkpoints through ``torch.distributed.checkpoint``, loaded into other layouts.

A run at ``dp=2, zero=1`` saves at step 10 (each rank writes only its shards) and trains on to
step 20. The checkpoint then (a) loads into ``dp=4, zero=3`` (another degree, another stage),
which trains steps 10-20 and must retrace the uninterrupted curve (1e-6: the same arithmetic up
to the summation order of four ranks instead of two), and (b) is consolidated by the command
line into one file that a plain ``GPT`` loads, whose logits equal the trained model's (1e-6: the
same fp32 weights, so in fact equal). On disk, no key carries a rank or a shard in its name.
"""

from __future__ import annotations

import subprocess
import sys
from functools import partial

import pytest
import torch

from benchmarks.zero_workload import curve_diff, micro_batch, tiny_gpt, train_zero
from llmlab.parallel.checkpoint import ShardedView, consolidate, flat_boxes, load_zero, save_zero
from llmlab.parallel.checkpoint.files import metadata
from llmlab.parallel.data.zero import ZeroEngine
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed
SAVE_AT = 10


def train_save_continue(rank: int, world: int, path: str) -> dict:
    first = train_zero(partial(ZeroEngine, stage=1), rank, world, steps=SAVE_AT)
    model, engine, opt, sched = first["state"]
    save_zero(path, engine, opt, extra={"scheduler": sched.state_dict(), "step": SAVE_AT})
    x, _ = micro_batch(0, 0)
    with torch.no_grad():
        logits = model(x)
    rest = train_zero(None, rank, world, steps=SAVE_AT, start=SAVE_AT, model=model, engine=engine,
                      opt=opt, sched=sched)  # fmt: skip
    return {"logits": logits, "losses": rest["losses"], "params": rest["params"]}


def resume(rank: int, world: int, path: str, stage: int) -> dict:
    from benchmarks.zero_workload import optimizer_for

    model = tiny_gpt(seed=7)  # other weights: everything must come from the checkpoint
    engine = ZeroEngine(model, stage=stage)
    opt, sched = optimizer_for(model)
    engine.rewire(opt)
    extra = load_zero(path, engine, opt)
    sched.load_state_dict(extra["scheduler"])
    rest = train_zero(None, rank, world, steps=SAVE_AT, start=extra["step"], model=model,
                      engine=engine, opt=opt, sched=sched)  # fmt: skip
    return {"losses": rest["losses"], "params": rest["params"], "memory": rest["memory"]}


def test_dp2_zero1_checkpoint_resumes_at_dp4_zero3_and_loads_into_plain_gpt(tmp_path) -> None:
    ckpt = tmp_path / "step10"
    straight = run_distributed(train_save_continue, 2, str(ckpt))[0]
    keys = metadata(ckpt).state_dict_metadata
    assert "model.blocks.0.attn.qkv.weight" in keys
    assert tuple(keys["model.blocks.0.attn.qkv.weight"].size) == (96, 32)  # global shape
    assert not (tmp_path / ".step10.partial").exists()

    resumed = run_distributed(resume, 4, str(ckpt), 3)[0]
    diff = curve_diff(resumed["losses"], straight["losses"])
    assert diff <= 1e-6, (diff, resumed["losses"], straight["losses"])

    out = tmp_path / "consolidated.pt"
    cmd = [sys.executable, "-m", "llmlab.parallel.checkpoint", "consolidate", str(ckpt), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    plain = tiny_gpt(seed=9)
    plain.load_state_dict(torch.load(out))  # strict: every key, the tied head included
    x, _ = micro_batch(0, 0)
    with torch.no_grad():
        logits = plain(x)
    torch.testing.assert_close(logits, straight["logits"], atol=1e-6, rtol=0)


def test_consolidate_names_a_missing_checkpoint(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \.metadata file"):
        consolidate(tmp_path / "nothing")


# --------------------------------------------------------------------------- no processes
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_flat_boxes_cover_every_range_exactly(shape) -> None:
    """Each box, read from the tensor, concatenates to exactly the flat range (any lo:hi)."""
    t = torch.arange(torch.Size(shape).numel()).view(shape)
    n = t.numel()
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            boxes = flat_boxes(shape, lo, hi)
            parts = [t[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].reshape(-1)
                     for offs, sizes in boxes]  # fmt: skip
            got = torch.cat(parts) if parts else torch.zeros(0, dtype=t.dtype)
            assert torch.equal(got, t.reshape(-1)[lo:hi]), (shape, lo, hi, boxes)
            assert len(boxes) <= 2 * len(shape) - 1


def test_sharded_view_rejects_boxes_outside_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"runs past the global shape \(4, 4\)"):
        ShardedView((4, 4), [((3, 0), torch.zeros(2, 4))])
