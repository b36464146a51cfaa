"""fp32 master weights behind a low-precision model: the optimizer only ever sees fp32.

Why: an fp16 weight near 1.0 has a spacing of 2**-10 ≈ 1e-3; an Adam update of lr·1 = 3e-4 is
rounded away entirely (``w + u == w``). Keeping an fp32 copy that accumulates the small updates
and re-rounding it into the fp16 model after every step loses nothing over many steps.

The step, in order (``unscale`` then ``step``; clipping may sit in between):

1. ``g32 = float32(g16) / S`` for each parameter; the low-precision grads are released.
2. ``found_inf`` over all fp32 grads (and across ranks).
3. overflow: drop the grads, leave weights *and optimizer state* untouched, back the scale off.
   Otherwise ``optimizer.step()`` on the fp32 masters, then ``w16 = round(w32)``.

This module is plain PyTorch (no Lightning), so a hand-written loop can use it too; the Lightning
plugins in :mod:`llmlab.parallel.precision.plugins` call it from their hooks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from llmlab.parallel.precision.scaler import DynamicLossScaler


class MasterWeights:
    """fp32 masters for ``params`` (the low-precision model parameters), plus an optional scaler.

    ``initial`` maps ``id(param)`` to a higher-precision starting value (the fp32 weights before
    the model was cast down), so the masters start exact rather than from rounded fp16 values.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        scaler: DynamicLossScaler | None = None,
        initial: dict[int, Tensor] | None = None,
        skip_nonfinite: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        initial = initial or {}
        unique: dict[int, nn.Parameter] = {}
        for p in params:  # tied weights (wte == lm_head) are one parameter, one master
            unique.setdefault(id(p), p)
        self.model_params = list(unique.values())
        self.masters = [
            nn.Parameter(initial.get(id(p), p.detach()).to(torch.float32).clone())
            for p in self.model_params
        ]
        self._master_of = {id(p): m for p, m in zip(self.model_params, self.masters, strict=True)}
        self.scaler = scaler
        self.skip_nonfinite = skip_nonfinite
        self.group = group
        self.skipped_steps = 0
        self.last_step_skipped = False

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def rewire(self, optimizer: Optimizer) -> None:
        """Point ``optimizer`` at the fp32 masters instead of the model's parameters.

        Only the ``params`` lists change: the group dicts (lr, weight decay, the LR scheduler's
        references) stay the same objects. Must run before the optimizer holds any state.
        """
        master_ids = {id(m) for m in self.masters}
        if all(id(p) in master_ids for g in optimizer.param_groups for p in g["params"]):
            return  # already rewired (Lightning calls connect again for validate/test)
        if len(optimizer.state) > 0:
            raise RuntimeError(
                "MasterWeights.rewire needs a fresh optimizer, but it already holds state for "
                f"{len(optimizer.state)} parameters; rewire before the first step"
            )
        for gi, group in enumerate(optimizer.param_groups):
            new = []
            for p in group["params"]:
                if id(p) in self._master_of:
                    new.append(self._master_of[id(p)])
                elif id(p) in master_ids:
                    new.append(p)
                else:
                    raise ValueError(
                        f"optimizer param group {gi} holds a parameter of shape {tuple(p.shape)} "
                        "that is not part of the converted model"
                    )
            group["params"] = new

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``S · loss`` computed in fp32, so the product itself cannot overflow."""
        if self.scaler is None:
            return loss
        return loss.float() * self.scaler.scale

    @torch.no_grad()
    def unscale(self) -> Tensor | bool:
        """Move the model's grads into the masters as fp32 ``g / S``; return ``found_inf`` (a
        device flag, not read here)."""
        inv = 1.0 / self.loss_scale
        for p, m in zip(self.model_params, self.masters, strict=True):
            if p.grad is None:
                m.grad = None
                continue
            g = p.grad.to(torch.float32)  # a copy for fp16/bf16; the model grad is dropped below
            if g.data_ptr() == p.grad.data_ptr():
                g = g.clone()
            m.grad = g.mul_(inv) if inv != 1.0 else g
            p.grad = None
        if self.scaler is None and not self.skip_nonfinite:
            return False
        return DynamicLossScaler.found_inf((m.grad for m in self.masters), self.group)

    @torch.no_grad()
    def step(self, optimizer: Optimizer, found_inf: Tensor | bool, **step_kwargs: Any) -> bool:
        """Step on the masters unless ``found_inf``; copy them back; update the scale.

        Returns whether the optimizer stepped. On overflow nothing but the scaler changes.
        ``found_inf`` (``unscale``'s device flag) is read here, the one host sync of the step.
        """
        found_inf = bool(found_inf)
        self.last_step_skipped = found_inf
        if found_inf:
            self.skipped_steps += 1
            for m in self.masters:
                m.grad = None
        else:
            with torch.enable_grad():
                optimizer.step(**step_kwargs)
            self.copy_to_model()
        if self.scaler is not None:
            self.scaler.update(found_inf)
        return not found_inf

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """``w_low = round(w32)``: the model's weights follow the masters."""
        for p, m in zip(self.model_params, self.masters, strict=True):
            p.copy_(m)

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "masters": [m.detach().clone() for m in self.masters],
            "skipped_steps": self.skipped_steps,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["masters"]
        if len(saved) != len(self.masters):
            raise ValueError(
                f"checkpoint holds {len(saved)} master weights, the model has {len(self.masters)}"
            )
        with torch.no_grad():
            for i, (m, s) in enumerate(zip(self.masters, saved, strict=True)):
                if m.shape != s.shape:
                    raise ValueError(
                        f"master weight {i}: checkpoint shape {tuple(s.shape)} != "
                        f"model shape {tuple(m.shape)}"
                    )
                m.copy_(s)
        self.copy_to_model()
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
