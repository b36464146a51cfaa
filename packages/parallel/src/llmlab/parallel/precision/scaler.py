"""Dynamic loss scaling: keep fp16 gradients inside fp16's range by multiplying the loss.

fp16 has 10 mantissa bits and a smallest normal of 6.1e-5: small gradients underflow to zero.
Multiplying the loss by ``S`` multiplies every gradient by ``S`` (the chain rule is linear), so
they land in range; the optimizer divides by ``S`` again in fp32. Too large an ``S`` overflows to
inf, so the scale is *dynamic*: an overflow skips the step and backs the scale off; a window of
clean steps grows it again ("ride the edge").

Policy, one call of :meth:`DynamicLossScaler.update` per optimizer step (``found_inf`` says
whether any gradient was inf/nan; across ranks when a process group is given). The overflow
flag itself (:meth:`DynamicLossScaler.found_inf`) stays on the device; the host reads it once
per optimizer step, where the step is taken or skipped:

* clean step: ``growth_tracker += 1``; with ``consecutive_hysteresis`` the hysteresis budget is
  refilled; when ``growth_tracker == growth_interval`` the scale is multiplied by
  ``growth_factor``, the tracker restarts at 0 and the hysteresis budget is refilled.
* overflow: ``growth_tracker = 0``; if more than one unit of hysteresis is left, one is spent
  and the scale stays (DeepSpeed's ``delayed_shift``); otherwise the scale is multiplied by
  ``backoff_factor`` but never goes below ``min_scale``. An overflow while already at
  ``min_scale`` raises (``at_min="raise"``) or keeps the scale (``at_min="clamp"``).

With ``hysteresis=1`` this is exactly ``torch.amp.GradScaler``'s update (checked against
``torch._amp_update_scale_`` in the tests). Against DeepSpeed's ``DynamicLossScaler`` (checked
against it in the tests): backoff, hysteresis, ``consecutive_hysteresis`` and the floor are the
same, step for step; growth differs by one step. This scaler grows on the ``w``-th consecutive
clean step (``w = growth_interval``), as GradScaler does; DeepSpeed grows on the ``(w+1)``-th,
counted from the start and from every overflow (its last-overflow marker starts at -1 and its
stable interval subtracts one). Without overflows: growth at steps ``w, 2w, 3w, ...`` here,
``w+1, 2w+1, 3w+1, ...`` in DeepSpeed.

The defaults are DeepSpeed's documented fp16 defaults (:data:`DEFAULTS`): the one place they are
written; ``FP16MasterPrecision`` and ``conf/precision/fp16_master.yaml`` read them from here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

AT_MIN_CHOICES = ("clamp", "raise")

# DeepSpeed's fp16 config defaults (``deepspeed.runtime.constants``: initial_scale_power 16,
# loss_scale_window 1000, hysteresis 2, consecutive_hysteresis false, min_loss_scale 1; its scale
# factor is fixed at 2). GradScaler's differ (growth_interval 2000, no hysteresis).
DEFAULTS = MappingProxyType(
    {
        "init_scale": 2.0**16,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_scale": 1.0,
        "at_min": "clamp",
    }
)


class LossScaleAtMinimumError(RuntimeError):
    """Gradients overflow even at the minimum loss scale: the run is diverging, not underflowing."""


class DynamicLossScaler:
    """Loss-scale policy with growth window, backoff, hysteresis and a floor.

    Defaults: DeepSpeed's (:data:`DEFAULTS`); ``hysteresis=1, growth_interval=2000`` is GradScaler.

    Args:
        init_scale: the first scale tried (``2**16`` as torch and DeepSpeed).
        growth_factor: multiply the scale by this after ``growth_interval`` clean steps.
        backoff_factor: multiply the scale by this after an overflow (past the hysteresis).
        growth_interval: the window of consecutive clean steps before growing.
        hysteresis: how many overflows are tolerated before the scale backs off (1 = none).
        consecutive_hysteresis: refill the hysteresis budget on every clean step (otherwise only
            when the scale grows), so only *consecutive* overflows back off.
        min_scale: the floor of the scale.
        at_min: ``"clamp"`` keeps the floor when overflowing at it, ``"raise"`` raises
            :class:`LossScaleAtMinimumError`.
    """

    def __init__(
        self,
        init_scale: float = DEFAULTS["init_scale"],
        growth_factor: float = DEFAULTS["growth_factor"],
        backoff_factor: float = DEFAULTS["backoff_factor"],
        growth_interval: int = DEFAULTS["growth_interval"],
        hysteresis: int = DEFAULTS["hysteresis"],
        consecutive_hysteresis: bool = DEFAULTS["consecutive_hysteresis"],
        min_scale: float = DEFAULTS["min_scale"],
        at_min: Literal["clamp", "raise"] = DEFAULTS["at_min"],
    ) -> None:
        _check_positive_finite("init_scale", init_scale)
        _check_positive_finite("min_scale", min_scale)
        if growth_factor <= 1.0 or not math.isfinite(growth_factor):
            raise ValueError(f"growth_factor must be a finite number > 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive integer, got {growth_interval!r}")
        if not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis must be a positive integer, got {hysteresis!r}")
        if at_min not in AT_MIN_CHOICES:
            raise ValueError(f"at_min={at_min!r} is not one of {list(AT_MIN_CHOICES)}")
        if init_scale < min_scale:
            raise ValueError(f"init_scale={init_scale} is below min_scale={min_scale}")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.at_min = at_min
        self.scale = float(init_scale)
        self.growth_tracker = 0
        self.hysteresis_left = hysteresis
        self.overflows = 0  # total overflowing steps seen (== skipped steps for the plugins)

    # ------------------------------------------------------------------ policy
    def update(self, found_inf: bool) -> None:
        """Advance the policy by one optimizer step; ``found_inf``: did any gradient overflow."""
        if found_inf:
            self.overflows += 1
            self.growth_tracker = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
                return
            if self.scale <= self.min_scale:
                if self.at_min == "raise":
                    raise LossScaleAtMinimumError(
                        f"gradients overflow at the minimum loss scale {self.min_scale}; "
                        "lower the learning rate or min_scale, or use at_min='clamp'"
                    )
                self.scale = self.min_scale
                return
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0
            self.hysteresis_left = self.hysteresis

    # --------------------------------------------------------------- overflow
    @staticmethod
    def found_inf(grads: Iterable[Tensor | None], group: dist.ProcessGroup | None = None) -> Tensor:
        """Whether any gradient holds inf or nan, on this rank or (in a distributed run) any rank:
        a 0-dim bool tensor on the gradients' device, never read here.

        Reading a device value stalls the host until the device has caught up, so the flag
        stays on the device until the one place that must decide: the master weights' ``step``
        reads it once per optimizer step (after clipping has been queued), and passes a plain
        bool to :meth:`update`. Every rank must agree on skipping, otherwise replicas drift
        apart: the flag is all-reduced with MAX over ``group`` whenever torch.distributed is
        initialised (a device collective, no host read).
        """
        grads = [g for g in grads if g is not None]
        if not grads:
            local = torch.zeros((), dtype=torch.bool)
        else:  # gradients may sit on several devices (naive model parallel): gather the flags
            device = grads[0].device
            flags = [torch.logical_not(torch.isfinite(g).all()).to(device) for g in grads]
            local = torch.stack(flags).any()
        if dist.is_available() and dist.is_initialized():
            flag = local.to(torch.float32).reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            return flag[0] > 0
        return local

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything resume needs to continue the policy exactly where it stopped."""
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_left": self.hysteresis_left,
            "overflows": self.overflows,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "min_scale": self.min_scale,
            "at_min": self.at_min,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_left"} - set(state)
        if missing:
            raise KeyError(f"loss-scaler state is missing {sorted(missing)}; got {sorted(state)}")
        for key, value in state.items():
            if not hasattr(self, key):
                raise KeyError(f"unknown loss-scaler state key {key!r}")
            setattr(self, key, value)

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self.scale:g}, growth_tracker={self.growth_tracker}, "
            f"hysteresis_left={self.hysteresis_left}/{self.hysteresis})"
        )


def _check_positive_finite(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
