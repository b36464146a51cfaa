"""Training telemetry: throughput, MFU, learning rate, gradient norm and peak memory per step.

MFU (model FLOPs utilisation) = achieved model FLOP/s ÷ peak FLOP/s of the devices used:

    MFU = tokens_per_second × flops_per_token / (peak_flops_per_device × devices)

* ``flops_per_token``: the *whole* model's training FLOPs per token (6·N + 12·L·d·T for the GPT;
  PaLM, appendix B), read in the callback's ``setup`` hook, which Lightning runs before the
  strategy shards or splits the model (after sharding a rank would count only its shard).
* ``peak_flops_per_device`` (logged once as ``perf/peak_flops``), in this order: the value
  configured; the GPU's dense bf16/fp16 tensor-core peak from its datasheet; or, on a CPU, the
  best fp32 matmul rate this machine has shown with this process's thread count — the best of
  several probes now, and of every earlier probe on the same machine (cached in
  ``$LLMLAB_CACHE_DIR/peak_flops.json``, default ``~/.cache/llmlab``). A single probe taken while
  other jobs share the cores reads low and inflates MFU (43 % one run, 85 % the next); the
  running best only moves up, towards what the cores sustain alone, so MFU on a CPU means
  "fraction of the best matmul rate this machine ever measured".

A mixture-of-experts model (one that meets :class:`RoutesTokens`: ``router_stats()``, each MoE
layer's statistics of its last forward, as ``llmlab.models.Llama`` has) also logs, per layer
``i``, ``moe/layer{i}/max_load``, ``mean_load`` (assignments per expert), ``imbalance`` (their
ratio), ``dropped`` and ``dropped_fraction`` (assignments over capacity), ``aux_loss`` and
``z_loss``: rank zero's
tokens of the step's last micro-batch (the loads of the other data ranks are not summed in).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import lightning as L
import torch

from llmlab.parallel.norm import global_grad_norm

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


def measure_cpu_peak_flops(
    sizes: tuple[int, ...] = (512, 1024), rounds: int = 3, repeats: int = 5, pause: float = 0.05
) -> float:
    """Best fp32 matmul FLOP/s of this process's threads: the ceiling a CPU run can reach.

    ``rounds`` bursts of ``repeats`` products per size, ``pause`` seconds apart, after one
    untimed product: the best single product wins, so a moment when the cores were free
    anywhere in the probe sets the figure (~0.5 s on 2 cores).
    """
    best = 0.0
    mats = {n: (torch.randn(n, n), torch.randn(n, n)) for n in sizes}
    for a, b in mats.values():
        a @ b  # warm-up: first-call allocations and thread start-up
    for r in range(rounds):
        for n, (a, b) in mats.items():
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                best = max(best, 2 * n**3 / (time.perf_counter() - start))
        if r + 1 < rounds:
            time.sleep(pause)
    return best


def _cache_file() -> Path:
    root = os.environ.get("LLMLAB_CACHE_DIR") or Path.home() / ".cache" / "llmlab"
    return Path(root) / "peak_flops.json"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine_key() -> str:
    """CPU model, thread count and torch version: what the matmul rate depends on."""
    return f"{cpu_model()} | {torch.get_num_threads()} threads | torch {torch.__version__}"


def cached_cpu_peak_flops(measured: float | None = None) -> float:
    """The best CPU matmul rate this machine has shown: max(a new probe, every earlier one).

    The cache is one JSON object, machine key -> FLOP/s; an unreadable or unwritable cache only
    loses the history, never the run.
    """
    measured = measure_cpu_peak_flops() if measured is None else measured
    path, key = _cache_file(), _machine_key()
    try:
        cache = json.loads(path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    earlier = cache.get(key)
    best = max(measured, float(earlier)) if isinstance(earlier, (int, float)) else measured
    if best != earlier:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**cache, key: best}, indent=1))
            tmp.replace(path)  # atomic: concurrent ranks never read half a file
        except OSError:
            pass
    return best


def device_peak_flops(device: torch.device) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_FLOPS.items():
            if key in name:
                return peak
        return 0.0  # unknown GPU: configure peak_flops_per_device
    return cached_cpu_peak_flops()


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


@runtime_checkable
class RoutesTokens(Protocol):
    """A mixture-of-experts model: each MoE layer's last-forward statistics by layer index,
    each with ``summary() -> dict[str, float]`` (``llmlab.models.moe.MoEStats``)."""

    def router_stats(self) -> dict[int, Any]: ...


def expert_load_metrics(model: Any) -> dict[str, float]:
    """``moe/layer{i}/<stat>`` of every MoE layer this rank holds (a pipeline stage: its own;
    empty for a dense model, or a stage without an MoE layer)."""
    if not isinstance(model, RoutesTokens):
        return {}
    try:
        stats = model.router_stats()
    except ValueError:  # a layer held here has not run a forward yet
        return {}
    return {
        f"moe/layer{i}/{name}": value
        for i, s in stats.items()
        for name, value in s.summary().items()
    }


class TrainingTelemetry(L.Callback):
    """Logs ``train/tokens_per_sec``, ``train/samples_per_sec``, ``train/mfu``, ``train/lr``,
    ``train/grad_norm``, ``sys/peak_memory_mb`` and, for a mixture of experts, ``moe/layer{i}/*``
    every optimizer step (rank zero logs)."""

    def __init__(self, peak_flops_per_device: float | None = None) -> None:
        self.peak_flops_per_device = peak_flops_per_device
        self._start: float | None = None
        self._flops_per_token: float | None = None
        self._log_peak = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning calls this before strategy.setup: the model is still whole here.
        model = getattr(pl_module, "model", None)
        fpt = getattr(model, "flops_per_token", None)
        if self._flops_per_token is None and callable(fpt):
            self._flops_per_token = float(fpt())

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.peak_flops_per_device is None:
            self.peak_flops_per_device = device_peak_flops(pl_module.device)
        self._log_peak = True

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
            grads = [p.grad for p in trainer.precision_plugin.main_params(optimizer)]
            if any(g is not None for g in grads):
                norm = global_grad_norm(grads, [1.0] * len(grads))
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
        if trainer.is_global_zero:
            metrics.update(expert_load_metrics(getattr(pl_module, "model", None)))
        if self._log_peak and self.peak_flops_per_device and trainer.is_global_zero:
            for logger in trainer.loggers:  # once (self.log would repeat it every step)
                logger.log_metrics(
                    {"perf/peak_flops": self.peak_flops_per_device}, step=trainer.global_step
                )
        self._log_peak = False
        for key, value in metrics.items():
            pl_module.log(key, float(value), on_step=True, on_epoch=False, rank_zero_only=True)
