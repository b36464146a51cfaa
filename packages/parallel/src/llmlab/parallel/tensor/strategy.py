"""``TensorParallelStrategy``: Megatron-style tensor parallelism (× data parallelism) in Lightning.

Layout (``llmlab.parallel.mesh``): ``world_size = data × tensor``, tensor innermost, checked
before anything is built. What the strategy does, in order:

* ``setup``: builds the process groups, shards ``lightning_module.model`` with
  :func:`parallelize` following the model's own ``tensor_parallel_plan()`` (divisibility of heads,
  hidden size and vocabulary checked first), and swaps ``lightning_module.loss_fn`` for the
  vocab-parallel cross-entropy; then builds the optimizer from the shards.
* each step: the forward and backward are the module's own (no DDP wrapper: tensor-parallel ranks
  hold different shards and must not be averaged); after the backward, gradients are averaged
  across the *data* group only; clipping by norm uses the full model's norm.
* ``distributed_sampler_kwargs`` reports the data-parallel size and rank, so every rank of a
  tensor-parallel group reads the same batch.
* every tensor-parallel collective of a step is recorded; ``tp/comm_bytes`` (payload),
  ``tp/comm_wire_bytes`` (ring-algorithm bytes per rank) and ``tp/dp_grad_bytes`` are logged.
* checkpoints are consolidated (full weights and full optimizer state), so they load into a plain
  model, into another tensor-parallel degree, and resume.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer

from llmlab.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups
from llmlab.parallel.tensor.accounting import CommLedger, record_into
from llmlab.parallel.tensor.checkpoint import (
    consolidated_optimizer_state,
    consolidated_state_dict,
    shard_optimizer_state,
    shard_state_dict,
)
from llmlab.parallel.tensor.cross_entropy import VocabParallelCrossEntropy
from llmlab.parallel.tensor.grads import average_data_parallel_grads, clip_grad_norm_
from llmlab.parallel.tensor.parallelize import parallelize, validate_plan

log = logging.getLogger(__name__)
CONSOLIDATED = "llmlab.tensor.consolidated/1"


def resolve_dims(world_size: int, tensor: int, data: int | None = None) -> ParallelDims:
    """``ParallelDims(data, 1, tensor)`` for ``world_size``; fails naming the numbers."""
    dims = ParallelDims.infer(world_size, tensor=tensor)
    if data is not None and data != dims.data:
        raise ValueError(
            f"tensor ({tensor}) × data ({data}) = {tensor * data}, but the world size is "
            f"{world_size}; set data={dims.data} or change trainer.devices / num_nodes"
        )
    return dims


def check_model_config(model: nn.Module, tensor: int) -> None:
    """Fail early with the model's own numbers (heads, hidden size, vocabulary) when a config
    is present; ``validate_plan`` repeats the checks per module for models without one."""
    config = getattr(model, "config", None)
    problems = []
    for field, label in (("n_head", "heads"), ("n_embd", "hidden size"), ("vocab_size", "vocab")):
        value = getattr(config, field, None)
        if isinstance(value, int) and value % tensor:
            problems.append(f"{label} {field}={value} is not divisible by tensor={tensor}")
    if problems:
        raise ValueError("tensor parallelism cannot shard this model: " + "; ".join(problems))


class TensorParallelStrategy(DDPStrategy):
    """Tensor parallelism of ``lightning_module.<model_attribute>`` (× data parallelism).

    ``tensor``: the tensor-parallel degree; ``data``: optional, checked against
    ``world_size / tensor``. ``sequence_parallel``: LayerNorm/dropout/residual on sequence shards
    (all-gather + reduce-scatter instead of all-reduce). ``model_attribute``: where the model is.
    """

    strategy_name = "tensor"

    def __init__(
        self,
        tensor: int = 2,
        sequence_parallel: bool = False,
        data: int | None = None,
        model_attribute: str = "model",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(tensor, int) or tensor < 1:
            raise ValueError(f"tensor must be a positive integer, got {tensor!r}")
        self.tensor = tensor
        self.data = data
        self.sequence_parallel = bool(sequence_parallel)
        self.model_attribute = model_attribute
        self._groups: ProcessGroups | None = None
        self._step_ledger = CommLedger()
        self._dp_bytes = 0
        self.last_comm: dict[str, float] = {}

    # ------------------------------------------------------------------- layout
    @property
    def dims(self) -> ParallelDims:
        return resolve_dims(self.world_size, self.tensor, self.data)

    @property
    def groups(self) -> ProcessGroups:
        if self._groups is None:
            raise RuntimeError("TensorParallelStrategy.setup has not run yet")
        return self._groups

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel replicas only: a tensor-parallel group reads one batch together."""
        dims = self.dims
        return {"num_replicas": dims.data, "rank": dims.coords(self.global_rank)[0]}

    def setup_environment(self) -> None:
        _ = self.dims  # fail before the process group starts when the layout cannot fit
        super().setup_environment()

    # -------------------------------------------------------------------- setup
    def _target_model(self) -> nn.Module:
        module = self.lightning_module
        model = getattr(module, self.model_attribute, None)
        if model is None or not hasattr(model, "tensor_parallel_plan"):
            raise TypeError(
                f"{type(module).__name__}.{self.model_attribute} must be a model with "
                "tensor_parallel_plan() (DESIGN §3)"
            )
        return model

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        dims = self.dims
        model = self._target_model()
        check_model_config(model, self.tensor)
        plan = model.tensor_parallel_plan()
        validate_plan(model, plan, self.tensor)
        self._groups = build_process_groups(dims)
        self.model_to_device()
        if getattr(model, "tensor_parallel", None) is None:
            parallelize(
                model,
                plan,
                self._groups.tensor,
                sequence_parallel=self.sequence_parallel,
                seed=torch.initial_seed(),
            )
        # After sharding: a master-weight plugin must see the shards the optimizer will hold.
        self.precision_plugin.convert_module(self.model)
        self.lightning_module.loss_fn = VocabParallelCrossEntropy(self._groups.tensor)
        log.info(
            "tensor parallel: data=%d × tensor=%d, rank %d at (dp, tp)=%s, sequence_parallel=%s",
            dims.data, dims.tensor, self.global_rank, self._groups.coords[::2],
            self.sequence_parallel,
        )  # fmt: skip
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        # Lightning clips with the local norm; every rank must clip with the full model's norm.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_full_norm  # type: ignore[method-assign]

    def configure_ddp(self) -> None:  # no DDP wrapper: data parallelism is done in ``backward``
        pass

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ---------------------------------------------------------------- training
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with record_into(self._step_ledger):
            return super().training_step(*args, **kwargs)

    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        with record_into(self._step_ledger):
            out = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._groups is not None and self._groups.dims.data > 1:
            params = [p for p in self.lightning_module.parameters() if p.grad is not None]
            self._dp_bytes += average_data_parallel_grads(params, self._groups.data)
        return out

    def optimizer_step(
        self, optimizer: Optimizer, closure: Any, model: Any = None, **kw: Any
    ) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kw)
        ledger = self._step_ledger
        self.last_comm = {
            "tp/comm_bytes": float(ledger.total_bytes),
            "tp/comm_wire_bytes": float(ledger.total_wire_bytes),
            **{f"tp/{kind}_bytes": float(v) for kind, v in ledger.totals().items()},
            "tp/dp_grad_bytes": float(self._dp_bytes),
        }
        ledger.clear()
        self._dp_bytes = 0
        trainer = self.lightning_module.trainer
        if self.is_global_zero and trainer.logger is not None:
            trainer.logger.log_metrics(self.last_comm, step=trainer.global_step)
        return out

    def _clip_grad_by_full_norm(self, optimizer: Optimizer, clip_val: float | int) -> None:
        params = list(self.precision_plugin.main_params(optimizer))
        clip_grad_norm_(params, float(clip_val), self.groups.tensor)

    # -------------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full (unsharded) weights under the plain model's keys (a collective)."""
        module = self.lightning_module
        if self._groups is None:
            return module.state_dict()
        return {k: v.cpu() for k, v in consolidated_state_dict(module, self.groups.tensor).items()}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load full weights: as they are before ``setup``, sliced to this rank's shards after."""
        module = self.lightning_module
        full = checkpoint["state_dict"]
        if self._groups is None:
            module.load_state_dict(full, strict=strict)
            return
        module.load_state_dict(shard_state_dict(module, full, self.groups.tensor), strict=strict)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        state = consolidated_optimizer_state(optimizer, self.groups.tensor)
        return {**state, "format": CONSOLIDATED}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            if saved.get("format") == CONSOLIDATED:
                saved = shard_optimizer_state(optimizer, saved, self.groups.tensor)
            optimizer.load_state_dict({k: v for k, v in saved.items() if k != "format"})
            _optimizers_to_device([optimizer], self.root_device)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="llmlab Megatron-style tensor parallelism (× DP)"
        )


if "tensor" not in StrategyRegistry:
    TensorParallelStrategy.register_strategies(StrategyRegistry)
