"""Training telemetry: throughput, MFU, learning rate, gradient norm and peak memory per step.

MFU (model FLOPs utilisation) = achieved model FLOP/s ÷ peak FLOP/s of the devices used:

    MFU = tokens_per_second × flops_per_token / (peak_flops_per_device × devices)

with ``flops_per_token`` from the model (6·N + 12·L·d·T for the GPT; PaLM, appendix B). Peak
FLOP/s comes from the GPU model's datasheet, or on a CPU from a short matmul probe (what this
machine actually sustains), or from ``peak_flops_per_device`` when given.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import lightning as L
import torch

# Dense bf16/fp16 tensor-core peaks (FLOP/s) from the vendors' datasheets.
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "V100": 125e12,
    "T4": 65e12,
}


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation in [0, 1] (see the module docstring)."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return tokens_per_second * flops_per_token / peak_flops


def measure_cpu_peak_flops(size: int = 512, repeats: int = 5) -> float:
    """Best fp32 matmul FLOP/s of this process's threads: the ceiling a CPU run can reach."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def device_peak_flops(device: torch.device) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_FLOPS.items():
            if key in name:
                return peak
        return 0.0  # unknown GPU: configure peak_flops_per_device
    return measure_cpu_peak_flops()


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def _engine_grad_norm(trainer: L.Trainer) -> Any:
    """DeepSpeed's ``get_global_grad_norm`` when the strategy wraps the model in its engine.

    Under ZeRO the gradients live in the optimizer's partitions (``p.grad`` is None or a
    shard), so only the engine knows the global norm; it computes it (before clipping) inside
    its step, hence it is read after the step.
    """
    return getattr(getattr(trainer.strategy, "model", None), "get_global_grad_norm", None)


class TrainingTelemetry(L.Callback):
    """Logs ``train/tokens_per_sec``, ``train/samples_per_sec``, ``train/mfu``, ``train/lr``,
    ``train/grad_norm`` and ``sys/peak_memory_mb`` every optimizer step (rank zero logs)."""

    def __init__(self, peak_flops_per_device: float | None = None) -> None:
        self.peak_flops_per_device = peak_flops_per_device
        self._start: float | None = None
        self._flops_per_token: float | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.peak_flops_per_device is None:
            self.peak_flops_per_device = device_peak_flops(pl_module.device)
        model = getattr(pl_module, "model", None)
        fpt = getattr(model, "flops_per_token", None)
        self._flops_per_token = fpt() if callable(fpt) else None

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """``train/grad_norm`` before clipping: the whole model's norm. A strategy that splits
        the model (tensor or pipeline parallel) knows how its pieces add up and says so through
        ``global_grad_norm(optimizer)`` (a collective; every rank calls this hook). Otherwise
        every rank holds the whole, averaged gradient: the norm of the optimizer's own gradients
        (fp32 master weights' where a precision plugin keeps them)."""
        if _engine_grad_norm(trainer):
            pass  # DeepSpeed computes it inside its step: logged after the step
        elif callable(getattr(trainer.strategy, "global_grad_norm", None)):
            norm = trainer.strategy.global_grad_norm(optimizer)
            pl_module.log("train/grad_norm", norm, on_step=True, on_epoch=False)
        else:
            params = trainer.precision_plugin.main_params(optimizer)
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                norm = torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])
                )
                pl_module.log("train/grad_norm", norm, on_step=True, on_epoch=False)
        pl_module.log("train/lr", optimizer.param_groups[0]["lr"], on_step=True, on_epoch=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: Any, batch_idx: int) -> None:
        if self._start is None:
            return
        elapsed = time.perf_counter() - self._start
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        replicas = int(kwargs.get("num_replicas", 1))
        samples = inputs.shape[0] * replicas
        tokens = inputs.numel() * replicas if inputs.dim() == 2 else 0
        metrics = {"train/samples_per_sec": samples / elapsed}
        if tokens:
            metrics["train/tokens_per_sec"] = tokens / elapsed
            if self._flops_per_token and self.peak_flops_per_device:
                devices = trainer.world_size
                metrics["train/mfu"] = mfu(
                    tokens / elapsed, self._flops_per_token, self.peak_flops_per_device * devices
                )
        engine_norm = _engine_grad_norm(trainer)
        norm = engine_norm() if engine_norm is not None else None
        if norm is not None:
            metrics["train/grad_norm"] = float(norm)
        metrics["sys/peak_memory_mb"] = peak_memory_bytes(pl_module.device) / 2**20
        for key, value in metrics.items():
            pl_module.log(key, float(value), on_step=True, on_epoch=False, rank_zero_only=True)
