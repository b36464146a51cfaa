"""DeepSpeed ZeRO through Lightning, on GPUs *and* on CPU-only machines (gloo).

ZeRO shards what data parallelism replicates: stage 1 the optimizer state, stage 2 also the
gradients (reduce-scatter instead of all-reduce), stage 3 also the parameters (all-gathered
layer by layer in forward and backward). Per replica, for N parameters trained with Adam in
fp32 (4 B weights + 4 B grads + 8 B moments) on R ranks, the model state costs

    DDP 16·N      ZeRO-1 8·N + 8·N/R      ZeRO-2 4·N + 12·N/R      ZeRO-3 16·N/R  bytes,

while the arithmetic — and so the loss curve — stays that of DDP on the same global batch.

Lightning's ``DeepSpeedStrategy`` is written for CUDA only: it refuses other accelerators,
checks that device indices equal local ranks (a CPU device has index ``None``), and passes
``device_rank=root_device.index`` (``None`` on CPU) to ``deepspeed.initialize``. DeepSpeed
itself runs ZeRO 1/2/3 on CPU with its CPU accelerator and gloo. ``PortableDeepSpeedStrategy``
fixes exactly those three spots when the accelerator is not CUDA and is the stock strategy on
GPUs. On CPU it also skips DeepSpeed's shared-memory comm op: a C++ extension JIT-compiled
(~1 min) on first use that only serves ``inference_all_reduce`` (AutoTP inference); ZeRO
training collectives go through ``torch.distributed`` either way.

Checkpoints are DeepSpeed directories (one file of module states, one optimizer shard per
rank); :func:`llmlab.parallel.checkpoint.deepspeed_state.consolidated_state_dict` turns one into
a plain single-process ``state_dict``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.strategies.deepspeed import _DEEPSPEED_AVAILABLE

from llmlab.parallel.compile import compile_refusal
from llmlab.parallel.preflight import RunConfig, check_data_parallel

ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("cpu", "nvme")
SHM_COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's name for the shared-memory comm op builder


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed setting that cannot work here, reported before any process starts."""


def validate_deepspeed_settings(
    stage: int,
    precision: str | None,
    on_cuda: bool,
    offload_optimizer_device: str = "cpu",
    offload_params_device: str = "cpu",
) -> None:
    """Reject what DeepSpeed would reject later (or worse, mid-run), naming the bad value."""
    if stage not in ZERO_STAGES:
        raise DeepSpeedConfigError(
            f"strategy.stage={stage!r}: ZeRO stage must be one of {ZERO_STAGES}"
        )
    for name, device in (
        ("offload_optimizer_device", offload_optimizer_device),
        ("offload_params_device", offload_params_device),
    ):
        if device not in OFFLOAD_DEVICES:
            raise DeepSpeedConfigError(
                f"strategy.{name}={device!r}: must be one of {OFFLOAD_DEVICES}"
            )
    if not on_cuda and precision is not None and precision.startswith("16"):
        raise DeepSpeedConfigError(
            f"precision {precision!r} with DeepSpeed on CPU: DeepSpeed's CPU accelerator has "
            "no fp16 ('Type fp16 is not supported on your device'). Use bf16-mixed, bf16-true "
            "or 32-true on CPU; fp16 needs a CUDA GPU."
        )


def disable_shm_comm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory comm op when its backend starts.

    ``deepspeed.comm`` builds the op only if ``deepspeed.ops.__compatible_ops__`` marks it
    compatible; that dict is computed once per process and edits to it persist (DeepSpeed
    caches it on the module for exactly that reason). The op only accelerates
    ``inference_all_reduce``, which ZeRO training never calls.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


class PortableDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy``, also on CPU (gloo); unchanged on CUDA.

    Keyword arguments are Lightning's (``stage``, ``offload_optimizer``, ``offload_parameters``,
    ``config`` ...). ``shm_comm_op`` (CPU only) re-enables DeepSpeed's shared-memory all-reduce
    op, at the price of a one-time JIT build cached in ``$TORCH_EXTENSIONS_DIR``.
    """

    strategy_name = "deepspeed_portable"

    def __init__(self, *args: Any, shm_comm_op: bool = False, **kwargs: Any) -> None:
        if not _DEEPSPEED_AVAILABLE:
            raise ImportError("PortableDeepSpeedStrategy needs `pip install deepspeed`")
        validate_deepspeed_settings(
            kwargs.get("stage", 2),
            None,
            on_cuda=True,  # the device is not known yet; _configure_launcher checks again
            offload_optimizer_device=kwargs.get("offload_optimizer_device", "cpu"),
            offload_params_device=kwargs.get("offload_params_device", "cpu"),
        )
        super().__init__(*args, **kwargs)
        self.shm_comm_op = shm_comm_op
        zero = (self.config or {}).get("zero_optimization") or {}
        offloading = "offload_optimizer" in zero or "offload_param" in zero
        if offloading:
            # Offload with the task's torch optimizer (not DeepSpeedCPUAdam, which JIT-compiles).
            self.config.setdefault("zero_force_ds_cpu_optimizer", False)

    @classmethod
    def check_config(cls, options: Mapping[str, Any], run: RunConfig) -> None:
        """No precision plugin (DeepSpeed's engine steps the optimizer in its own precision, so
        a plugin's fp32 masters or fp8 layers would not be what trains), no compile (not
        checked); the global batch split over every rank. Its own settings are checked when it
        is built (:func:`validate_deepspeed_settings`)."""
        if run.plugin is not None:
            raise ValueError(
                f"precision plugin {run.plugin.__name__} with strategy=deepspeed is refused: "
                "DeepSpeed's engine steps the optimizer in its own precision (its config's bf16 "
                "/ fp16), so the plugin's fp32 masters or fp8 layers would not be what trains; "
                "valid with deepspeed: precision=fp32 or bf16_mixed"
            )
        if run.transforms.compile:
            raise ValueError(compile_refusal(cls.__name__))
        check_data_parallel(run)

    @property
    def on_cuda(self) -> bool:
        return isinstance(self.accelerator, CUDAAccelerator)

    # Lightning calls this once accelerator and precision are known, before any process starts.
    def _configure_launcher(self) -> None:
        if self.accelerator is not None and self.precision_plugin is not None:
            zero = (self.config or {}).get("zero_optimization") or {}
            validate_deepspeed_settings(
                zero.get("stage", 0), str(self.precision_plugin.precision), self.on_cuda
            )
        super()._configure_launcher()

    def setup_environment(self) -> None:
        if self.on_cuda:
            super().setup_environment()
            return
        # Skip DeepSpeedStrategy's "CUDA only" refusal; DDPStrategy's setup remains.
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if self.on_cuda:
            super().setup_distributed()
            return
        # CPU devices have no index, so the CUDA index-vs-local-rank validation does not apply.
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        if not self.shm_comm_op:
            disable_shm_comm_op()
        self._init_deepspeed_distributed()

    @property
    def device_rank(self) -> int:
        """The device index DeepSpeed's engine binds to: the CUDA index, or the local rank."""
        index = self.root_device.index
        return self.local_rank if index is None else index

    def _setup_model_and_optimizer(
        self, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any = None
    ) -> tuple[Any, Any]:
        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.device_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model: torch.nn.Module) -> None:
        if self.on_cuda:
            super()._initialize_deepspeed_inference(model)
            return
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        if "bf16" in self.config:
            config["bf16"] = self.config["bf16"]
        if self.zero_stage_3:
            config["zero_allow_untested_optimizer"] = self.config["zero_allow_untested_optimizer"]
            config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.device_rank),
            config=config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )
