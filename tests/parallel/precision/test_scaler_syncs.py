"""The loss scaler's overflow flag stays on the device and is read once per optimizer step.

A host read of a device value (``.item()``, ``bool()``, ``float()``) makes the host wait for
the device to catch up, so the loss-scaling path must not read the flag more than it has to:
once, where the step is taken or skipped. Every such read reaches torch's dispatcher as
``aten._local_scalar_dense``; :class:`HostReads` counts them and names the llmlab function that
made each (the innermost llmlab frame), so the count holds on CPU as on CUDA. Checked in a
hand-written loop of several micro-batches per step with an overflow, and in a real Lightning
``Trainer`` with the N-D strategy's pipeline (2 stages × 4 micro-batches, fp16 master weights).
Behaviour (skip on overflow, backoff) is asserted in the same runs.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmlab.parallel.precision import DynamicLossScaler, MasterWeights
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import lm_loss, rank_trainer, tiny_gpt, tiny_task, tiny_tokens, token_batch

PRECISION_CODE = ("llmlab/parallel/precision/", "llmlab/parallel/data/zero_precision.py")


def _is_dispatch_machinery(filename: str) -> bool:
    """torch's private plumbing between a read and this mode (``torch/_dynamo``, ``_ops.py``,
    ``_compile.py``, ``utils/_python_dispatch.py``) and this file itself."""
    return "/torch/_" in filename or "/torch/utils/_" in filename or filename == __file__


class HostReads(TorchDispatchMode):
    """Counts host reads of device values by the function that made them (``file:function``;
    a read inside ``torch.optim`` counts for the optimizer, not for the code that called it)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_function: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            frame = sys._getframe(1)  # the Python code that asked, past the dispatch machinery
            while frame is not None and _is_dispatch_machinery(frame.f_code.co_filename):
                frame = frame.f_back
            if frame is not None:
                self.by_function[f"{frame.f_code.co_filename}:{frame.f_code.co_name}"] += 1
        return func(*args, **(kwargs or {}))

    def in_precision_code(self) -> Counter[str]:
        """The reads made by the loss-scaling code, as ``file:function``."""
        return Counter(
            {
                where.rsplit("/", 1)[1]: n
                for where, n in self.by_function.items()
                if any(part in where for part in PRECISION_CODE)
            }
        )


def test_found_inf_returns_a_device_flag_without_reading_it() -> None:
    grads = [torch.ones(3), None, torch.tensor([1.0, float("inf")])]
    with HostReads() as reads:
        flag = DynamicLossScaler.found_inf(grads)
    assert isinstance(flag, torch.Tensor) and flag.dtype == torch.bool and flag.dim() == 0
    assert flag.device == grads[0].device
    assert sum(reads.by_function.values()) == 0, reads.by_function
    assert bool(flag)


def test_one_read_per_optimizer_step_over_micro_batches() -> None:
    """4 optimizer steps × 3 micro-batches (a loss scale and a backward each), an overflow
    injected into the third step: 4 reads, all in ``MasterWeights.step``, none per micro-batch
    and none in ``unscale``; the overflowing step is skipped and the scale backs off."""
    steps, micro, overflow_at = 4, 3, 2
    model = tiny_gpt(n_layer=1).to(torch.float16)
    scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=100, hysteresis=1)
    masters = MasterWeights(model.parameters(), scaler)
    opt = torch.optim.SGD(masters.masters, lr=0.1)
    masters_before, scales = [], []
    with HostReads() as reads:
        for step in range(steps):
            masters_before.append([m.detach().clone() for m in masters.masters])
            for i in range(micro):
                x, y = token_batch(rows=2, seed=10 * step + i)
                masters.scale_loss(lm_loss(model(x).float(), y) / micro).backward()
            if step == overflow_at:
                model.blocks[0].mlp.fc.weight.grad[0, 0] = float("inf")
            masters.step(opt, masters.unscale())
            scales.append(scaler.scale)
    assert reads.in_precision_code() == Counter({"master.py:step": steps}), reads.by_function
    llmlab = {k: n for k, n in reads.by_function.items() if "/llmlab/" in k}
    assert len(llmlab) == 1, f"the GPT's forward and backward read nothing: {llmlab}"
    assert masters.skipped_steps == 1 and scales == [256.0, 256.0, 128.0, 128.0]
    after_skip = [m.detach() for m in masters.masters]
    assert all(torch.equal(a, b) for a, b in zip(masters_before[overflow_at], masters_before[3]))
    assert not all(torch.equal(a, b) for a, b in zip(masters_before[3], after_skip))


def _pipeline_fp16_reads(rank: int, world: int, steps: int) -> dict:
    from llmlab.parallel.precision import FP16MasterPrecision
    from llmlab.parallel.strategy import NDParallelStrategy

    strategy = NDParallelStrategy(pipeline=2, microbatches=4, timeline_every_n_steps=0)
    plugin = FP16MasterPrecision(init_scale=2.0**8)
    trainer = rank_trainer(strategy, world, steps, plugins=[plugin], limit_val_batches=0)
    task = tiny_task(max_steps=steps)
    with HostReads() as reads:
        trainer.fit(task, datamodule=tiny_tokens(steps, batch=8))
    return {"reads": dict(reads.in_precision_code()), "steps": trainer.global_step}


@pytest.mark.distributed
def test_pipeline_micro_batches_read_the_flag_once_per_step() -> None:
    """The real N-D strategy, 2 pipeline stages × 4 micro-batches, fp16 master weights: the
    engine scales each micro-batch's loss on the last stage, the plugin steps once per batch;
    each rank reads the flag exactly once per optimizer step."""
    steps = 3
    for result in run_distributed(_pipeline_fp16_reads, 2, steps):
        assert result["steps"] == steps
        assert result["reads"] == {"master.py:step": steps}, result
