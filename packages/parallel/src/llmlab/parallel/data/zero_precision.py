"""Mixed precision under ZeRO: the engine's fp32 shards *are* the master weights.

:class:`~llmlab.parallel.precision.master.MasterWeights` keeps a full fp32 copy of every
parameter; under ZeRO-1/2/3 that copy is exactly what gets sharded, so the engine keeps the fp32
master *shards* itself and steps them, and what remains for the precision plugin is the loss
scale. :class:`ZeroMasterWeights` has ``MasterWeights``' interface (``rewire``, ``scale_loss``,
``unscale``, ``step``, ``state_dict``...), so a precision plugin swaps one for the other:

* ``convert_module``: as today (remember fp32 values, cast the model); the strategy builds the
  :class:`~llmlab.parallel.data.zero.ZeroEngine` on the cast model with ``initial=`` those values.
* ``connect``: ``self.masters = ZeroMasterWeights(engine, scaler)`` instead of ``MasterWeights``
  (``rewire`` points the optimizer at the fp32 pieces).
* ``pre_backward`` / ``optimizer_step``: unchanged -- ``scale_loss``; then ``unscale`` divides
  the reduced fp32 gradient shards by the scale and agrees on overflow across every rank (each
  rank sees only its shard, so one rank's inf must skip the step everywhere); ``step`` steps or
  skips, and the engine all-gathers the new compute parameters after a real step.

Stage 0 is plain data parallelism: the plugin's own ``MasterWeights`` works there unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from llmlab.parallel.data.zero import ZeroEngine
from llmlab.parallel.precision.scaler import DynamicLossScaler


class ZeroMasterWeights:
    """Loss scaling and step skipping over a :class:`ZeroEngine`'s fp32 master shards.

    ``group``: the ranks that must agree on skipping a step (default: all of them).
    """

    def __init__(
        self,
        engine: ZeroEngine,
        scaler: DynamicLossScaler | None = None,
        skip_nonfinite: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if engine.stage == 0:
            raise ValueError(
                "ZeRO stage 0 keeps no master shards; use precision.master.MasterWeights there"
            )
        self.engine = engine
        # the compute parameters it stands for (a precision plugin compares them with its own)
        self.model_params = [p for u in engine.units for p in u.params]
        self.scaler = scaler
        self.skip_nonfinite = skip_nonfinite
        self.group = group
        self.skipped_steps = 0
        self.last_step_skipped = False

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def rewire(self, optimizer: Optimizer) -> None:
        self.engine.rewire(optimizer)

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``S · loss`` computed in fp32, so the product itself cannot overflow."""
        return loss if self.scaler is None else loss.float() * self.scaler.scale

    @torch.no_grad()
    def unscale(self) -> Tensor | bool:
        """Divide the reduced gradient shards by the scale; whether any rank saw inf/nan (a
        device flag, not read here)."""
        if self.scaler is not None and self.loss_scale != 1.0:
            self.engine.scale_grads_(1.0 / self.loss_scale)
        if self.scaler is None and not self.skip_nonfinite:
            return False
        return DynamicLossScaler.found_inf(self.engine.optimizer_grads(), self.group)

    @torch.no_grad()
    def step(self, optimizer: Optimizer, found_inf: Tensor | bool, **step_kwargs: Any) -> bool:
        """Step the shards unless ``found_inf`` (then nothing but the scaler changes); the
        device flag is read here, the one host sync of the step."""
        found_inf = bool(found_inf)
        self.last_step_skipped = found_inf
        if found_inf:
            self.skipped_steps += 1
            optimizer.zero_grad(set_to_none=True)
        else:
            with torch.enable_grad():
                optimizer.step(**step_kwargs)  # the engine's post-step hook gathers
        if self.scaler is not None:
            self.scaler.update(found_inf)
        return not found_inf

    def copy_to_model(self) -> None:
        self.engine.refresh_params()

    def state_dict(self) -> dict[str, Any]:
        """The scaler only: the masters are in the sharded checkpoint, under the model's keys."""
        return {
            "skipped_steps": self.skipped_steps,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
