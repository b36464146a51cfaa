"""Host synchronisation in an fp16 training step: the overflow flag read on the host vs kept on
the device.

A dynamic loss scaler must know whether any gradient overflowed before it steps (skip or not)
and before it updates the scale. Reading that flag on the host (``bool(flag)`` / ``.item()``)
makes the CPU wait until the GPU has finished the backward and the overflow check: the queue of
launched kernels drains, and the next step's kernels start only after the host has launched
them again. Kept on the device, the decision is data: the optimizer skips its own update when
the flag is set and the scale is updated by a kernel, so the host never waits.

Two steps, the same fp16 MLP with fp32 master weights, the same policy (GradScaler's: backoff
0.5, growth 2.0 after ``GROWTH_INTERVAL`` clean steps, no hysteresis), the same fused AdamW:

* ``llmlab`` (:class:`HostFlagStep`): ``llmlab.parallel.precision.MasterWeights`` with a
  ``DynamicLossScaler``. Its ``found_inf`` stays on the device until ``MasterWeights.step``,
  which reads it once (``bool``) to skip or step and passes a Python bool to the scaler.
* reference (:class:`DeviceFlagStep`): the scale and the flag are tensors;
  ``torch._amp_foreach_non_finite_check_and_unscale_`` unscales and sets the flag, fused AdamW
  takes it as ``found_inf`` and leaves weights and moments untouched when it is set (a
  torch.where-style skip inside the kernel), ``torch._amp_update_scale_`` updates the scale: no
  host read at all. This is how ``torch.amp.GradScaler`` drives fused optimizers.

Both start from one initial scale large enough to overflow (so the first steps are skipped and
the scale backs off) and end with bit-identical master weights and scale, checked every run.
Host reads are counted per step: on CUDA with ``torch.cuda.set_sync_debug_mode("warn")`` (every
synchronising call, also those inside torch), on the CPU by counting the Python-level reads
(``Tensor.item``, ``__bool__``, ``__float__``, ``__int__``, ``tolist``). Times are per step over a
run of steps with one synchronisation at the end, best of ``REPEATS``, both variants interleaved.

On a CPU every op has finished when it returns, so a host read waits for nothing: the CPU
figures show that the device-side step costs no more work (ratio near 1), not what a sync costs
on a GPU. ``python -m benchmarks.sync`` (``--smoke``: toy sizes, one repeat).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import Row, parse_args, report
from llmlab.parallel.precision import DynamicLossScaler, MasterWeights

NAME = "sync"
INIT_SCALE = 2.0**24  # overflows fp16 gradients at first: the first steps are skipped
GROWTH_INTERVAL = 8
BACKOFF, GROWTH = 0.5, 2.0
LR = 1e-3
REPEATS = 5
HOST_READS = ("item", "__bool__", "__float__", "__int__", "tolist")


def make_model(d: int, hidden: int, layers: int, device: str) -> nn.Module:
    """An fp16 MLP (``layers`` blocks of Linear-GELU-Linear), the same weights for every seed 0."""
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)) for _ in range(layers)
    ]
    return nn.Sequential(*blocks).to(device=device, dtype=torch.float16)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


class HostFlagStep:
    """llmlab's fp16 step: ``MasterWeights`` reads ``found_inf`` on the host once per step."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        scaler = DynamicLossScaler(
            init_scale=INIT_SCALE,
            growth_factor=GROWTH,
            backoff_factor=BACKOFF,
            growth_interval=GROWTH_INTERVAL,
            hysteresis=1,
        )
        self.master = MasterWeights(model.parameters(), scaler)
        self.optimizer = torch.optim.AdamW(self.master.masters, lr=LR, fused=True)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.master.scale_loss(loss_of(self.model, x, y)).backward()
        self.master.step(self.optimizer, self.master.unscale())

    def state(self) -> tuple[list[torch.Tensor], float]:
        return [m.detach() for m in self.master.masters], self.master.scaler.scale


class DeviceFlagStep:
    """The same step with the flag and the scale on the device: nothing is read on the host."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = list(model.parameters())
        device = self.params[0].device
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=LR, fused=True)
        self.scale = torch.full((), INIT_SCALE, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.found_inf = torch.zeros((), device=device)
        self.optimizer.found_inf = self.found_inf  # fused AdamW skips on the device when set

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.backward_and_unscale(x, y)
        with torch.no_grad():
            self.optimizer.step()
            torch._foreach_copy_(self.params, self.masters)  # unchanged masters if skipped
            self.update_scale()

    def backward_and_unscale(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The scaled backward, the fp32 gradients moved onto the masters, unscaled, and
        ``found_inf`` set on the device where one is not finite (no host read)."""
        (loss_of(self.model, x, y) * self.scale).backward()
        with torch.no_grad():
            grads = [p.grad.float() for p in self.params]
            for p, m, g in zip(self.params, self.masters, grads, strict=True):
                p.grad, m.grad = None, g
            self.found_inf.zero_()
            inv_scale = self.scale.double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inv_scale)

    def update_scale(self) -> None:
        torch._amp_update_scale_(
            self.scale, self.growth_tracker, self.found_inf, GROWTH, BACKOFF, GROWTH_INTERVAL
        )

    def state(self) -> tuple[list[torch.Tensor], float]:
        return [m.detach() for m in self.masters], float(self.scale)


class HostGatedStep(DeviceFlagStep):
    """:class:`DeviceFlagStep` with the skip decided on the host: ``found_inf.item()`` gates the
    optimizer step. The same kernels otherwise, so its difference from the device step is the
    read itself."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.optimizer.found_inf = None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.backward_and_unscale(x, y)
        with torch.no_grad():
            if self.found_inf.item():  # the host waits here for the backward and the check
                for m in self.masters:
                    m.grad = None
            else:
                self.optimizer.step()
                torch._foreach_copy_(self.params, self.masters)
            self.update_scale()


@contextlib.contextmanager
def count_host_reads() -> Iterator[dict[str, int]]:
    """Count host reads of tensor values inside the block: Python-level reads of any tensor
    (``HOST_READS``), and on CUDA every synchronising call torch reports in sync-debug mode."""
    counts = {"python_reads": 0, "cuda_syncs": 0}
    patched = {}
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)
        patched[name] = (name in torch.Tensor.__dict__, original)

        def counting(self, *args, _original=original, **kwargs):
            counts["python_reads"] += 1
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counting)
    cuda = torch.cuda.is_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode(previous)
            for name, (own, original) in patched.items():
                if own:
                    setattr(torch.Tensor, name, original)
                else:
                    delattr(torch.Tensor, name)
    counts["cuda_syncs"] = sum("synchroniz" in str(w.message) for w in caught)


def reads_per_step(step, batches) -> dict[str, float]:
    """Host reads per step over ``batches`` (a separate run: counting slows the reads down)."""
    with count_host_reads() as counts:
        for x, y in batches:
            step(x, y)
    return {k: v / len(batches) for k, v in counts.items()}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step, batches, device: str) -> float:
    """Seconds per step over ``batches``, one synchronisation at the end."""
    _sync(device)
    start = time.perf_counter()
    for x, y in batches:
        step(x, y)
    _sync(device)
    return (time.perf_counter() - start) / len(batches)


def run(d: int, hidden: int, layers: int, batch: int, steps: int, repeats: int, device: str):
    """The three steps on the same batches; returns (rows, notes)."""
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(batch, d, generator=g).to(device, torch.float16),
            torch.randn(batch, d, generator=g).to(device),
        )
        for _ in range(steps)
    ]
    steps_of = {
        "host": HostFlagStep(make_model(d, hidden, layers, device)),
        "gated": HostGatedStep(make_model(d, hidden, layers, device)),
        "device": DeviceFlagStep(make_model(d, hidden, layers, device)),
    }
    reads = {k: reads_per_step(step, batches) for k, step in steps_of.items()}
    best = dict.fromkeys(steps_of, float("inf"))
    for _ in range(repeats):  # interleaved, so drift on a shared machine hits all alike
        for k, step in steps_of.items():
            best[k] = min(best[k], time_steps(step, batches, device))
    states = {k: step.state() for k, step in steps_of.items()}
    for k in ("host", "gated"):
        (w, scale), (w_dev, scale_dev) = states[k], states["device"]
        if scale != scale_dev or not all(torch.equal(a, b) for a, b in zip(w, w_dev, strict=True)):
            raise AssertionError(
                f"{k} and device steps diverged (scale {scale} vs {scale_dev}): comparison void"
            )
    kind = "cuda_syncs" if device == "cuda" else "python_reads"
    n = {k: reads[k][kind] for k in reads}
    total = (1 + repeats) * steps
    model = f"fp16 MLP {layers}x{d}/{hidden} batch {batch}"

    def row(k: str, what: str) -> Row:
        return Row(
            name=f"{model}: {what}, {n[k]:g} vs {n['device']:g} host reads/step",
            llmlab=1e3 * best[k],
            reference=1e3 * best["device"],
            reference_name="flag kept on device",
            unit="ms",
            higher_is_better=False,
            extra={"reads_per_step": reads, "steps_per_timing": steps, "repeats": repeats},
        )

    rows = [row("host", "MasterWeights step"), row("gated", "same kernels, skip read on host")]
    notes = (
        f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}; host reads per "
        f"step counted as {kind.replace('_', ' ')}: llmlab's MasterWeights (bool(found_inf) in "
        f"step) {n['host']:g}; the device-kept step (fused AdamW found_inf + "
        f"torch._amp_update_scale_) {n['device']:g}; that step with found_inf.item() gating the "
        f"optimizer {n['gated']:g}. Times: ms per step over {steps} steps with one "
        f"synchronisation at the end, best of {repeats}, interleaved; ratio = device-kept / row "
        f"(< 1: the device-kept step is faster). After {total} steps from scale "
        f"{INIT_SCALE:g} (overflowing at first) all three hold bit-identical master weights and "
        f"scale {states['device'][1]:g} ({steps_of['host'].master.skipped_steps} steps "
        "skipped). On a CPU a host read waits for nothing (every op has finished when it "
        "returns), so the second row is the read's own cost there and the first row's gap is "
        "MasterWeights' per-tensor unscale and overflow check (several small ops per "
        "parameter) against torch's foreach kernels; what a sync costs on a GPU (its queue "
        "drains while the host waits) shows only on a GPU."
    )
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = parse_args(parser, argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        sizes = dict(d=16, hidden=32, layers=1, batch=4, steps=3, repeats=1)
    elif device == "cuda":
        sizes = dict(d=1024, hidden=4096, layers=4, batch=64, steps=50, repeats=REPEATS)
    else:  # fp16 has no native CPU GEMM (~70x slower than fp32): small, so steps stay ~10 ms
        torch.set_num_threads(1)
        sizes = dict(d=128, hidden=512, layers=2, batch=32, steps=20, repeats=REPEATS)
    rows, notes = run(**sizes, device=device)
    report(NAME, rows, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
