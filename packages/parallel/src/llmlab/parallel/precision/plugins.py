"""Lightning precision plugins: low-precision model, fp32 master weights, dynamic loss scaling.

How the plugin hooks into Lightning (``Strategy.setup`` calls ``convert_module`` before the
optimizers exist and ``connect`` right after ``configure_optimizers``):

* ``convert_module``: remember each parameter's fp32 value, then cast the model down.
* ``connect``: build :class:`MasterWeights` and *rewire* every optimizer's param groups to the
  fp32 masters. The LightningModule's ``configure_optimizers`` stays unaware of precision, the
  optimizer state (Adam moments) is fp32 from the first step, and gradient clipping (which reads
  ``optimizer.param_groups``) clips the unscaled fp32 grads.
* ``pre_backward``: ``loss · S`` (fp32 product).
* ``optimizer_step``: run the closure (forward + backward on the fp16 model), move grads to
  the masters unscaled, check overflow, let clipping hooks run, then step or skip.
* ``state_dict``: the scaler *and* the masters, so resume is exact (the model's own checkpoint
  holds only the rounded low-precision weights).

What a strategy that splits the model needs from a plugin, it asks through the plugin's own
methods, never by replacing them: ``masters`` (the fp32 copies and their ``model_params``),
``fp32_values`` (the values before the cast, to start sharded masters from) and ``use_masters``
(step through masters the strategy keeps, such as ZeRO's fp32 shards), ``scaler`` and
``state_dict`` / ``load_state_dict``, and ``clip_by_norm_of`` (:class:`WholeModelClipping`):
clipping by the whole model's norm, which only the strategy can compute. Lightning's own fp32
and autocast plugins get that hook as :func:`with_whole_model_clipping`'s subclasses.

Lightning's ``precision="16-mixed"`` silently becomes bf16 on CPU; these plugins never change the
dtype behind your back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import (
    DoublePrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_utilities import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from llmlab.parallel.norm import clip_by_total_norm_
from llmlab.parallel.precision.fp8 import Float8Linear, Float8Matmul, convert_to_float8
from llmlab.parallel.precision.master import MasterWeights
from llmlab.parallel.precision.scaler import DEFAULTS as SCALER_DEFAULTS
from llmlab.parallel.precision.scaler import DynamicLossScaler

log = logging.getLogger(__name__)

DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16}  # fmt: skip


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"dtype {name} is not a low-precision float; valid: {sorted(DTYPES)}")
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {sorted(DTYPES)}")
    return DTYPES[name]


class WholeModelClipping:
    """Clipping by norm that can measure the whole model.

    Lightning clips through the precision plugin (``clip_grad_by_norm(optimizer, clip_val)``),
    which sees only this rank's gradients. A strategy that splits the model hands the plugin the
    norm of the whole model with :meth:`clip_by_norm_of` (a function of the optimizer, a
    collective every rank calls); the gradients the optimizer steps are then scaled by
    ``min(1, clip / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does. Without one,
    Lightning's own clipping.
    """

    _grad_norm: Callable[[Optimizer], Tensor] | None = None

    def clip_by_norm_of(self, grad_norm: Callable[[Optimizer], Tensor] | None) -> None:
        """Clip by ``grad_norm(optimizer)`` from now on (``None``: this rank's own norm)."""
        self._grad_norm = grad_norm

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float | int) -> None:
        if self._grad_norm is None:
            super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]
            return
        grads = [p.grad for p in self.main_params(optimizer)]  # type: ignore[attr-defined]
        clip_by_total_norm_(grads, self._grad_norm(optimizer), float(clip_val))


class WholeModelPrecision(WholeModelClipping, Precision):
    """Lightning's ``32-true``, clipping by a norm a strategy gives."""


class WholeModelMixedPrecision(WholeModelClipping, MixedPrecision):
    """Lightning's ``bf16-mixed`` / ``16-mixed`` (autocast), clipping by a norm a strategy
    gives."""


class WholeModelHalfPrecision(WholeModelClipping, HalfPrecision):
    """Lightning's ``bf16-true`` / ``16-true``, clipping by a norm a strategy gives."""


class WholeModelDoublePrecision(WholeModelClipping, DoublePrecision):
    """Lightning's ``64-true``, clipping by a norm a strategy gives. Its use: exactness tests,
    where fp64 shrinks the summation-order rounding that separates two layouts' runs by ~9
    decimal digits, so a real difference cannot hide under it."""


def with_whole_model_clipping(plugin: Precision) -> Precision:
    """``plugin`` if it takes a strategy's norm (:class:`WholeModelClipping`), else Lightning's
    stock plugin of the same precision as the llmlab subclass that does; any other plugin as it
    is (a strategy that must clip by its norm refuses it then)."""
    if isinstance(plugin, WholeModelClipping):
        return plugin
    kind = type(plugin)
    if kind is Precision:
        return WholeModelPrecision()
    if kind is MixedPrecision:
        mixed: Any = plugin
        return WholeModelMixedPrecision(mixed.precision, mixed.device, mixed.scaler)
    if kind is HalfPrecision:
        return WholeModelHalfPrecision(plugin.precision)  # type: ignore[arg-type]
    if kind is DoublePrecision:
        return WholeModelDoublePrecision()
    return plugin


class MasterWeightPrecision(WholeModelClipping, Precision):
    """Model weights in ``dtype``, fp32 master weights in the optimizer, optional loss scaling.

    Args:
        dtype: ``"float16"`` or ``"bfloat16"``: the dtype of the model's weights and compute.
        loss_scale: ``"dynamic"`` (a :class:`DynamicLossScaler` from ``scaler_kwargs``), a
            number (a static scale), or ``None`` (no scaling: bf16 has fp32's exponent range).
        skip_nonfinite: skip steps whose gradients hold inf/nan even without a scaler.
        **scaler_kwargs: ``init_scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval``, ``hysteresis``, ``consecutive_hysteresis``, ``min_scale``,
            ``at_min`` (see :class:`DynamicLossScaler`).
    """

    def __init__(
        self,
        dtype: str | torch.dtype = "float16",
        loss_scale: Literal["dynamic"] | float | None = "dynamic",
        skip_nonfinite: bool = True,
        **scaler_kwargs: Any,
    ) -> None:
        self.dtype = _dtype(dtype)
        self.precision = "16-true" if self.dtype == torch.float16 else "bf16-true"
        if loss_scale == "dynamic":
            self.scaler: DynamicLossScaler | None = DynamicLossScaler(**scaler_kwargs)
        elif loss_scale is None:
            if scaler_kwargs:
                raise ValueError(
                    f"scaler options {sorted(scaler_kwargs)} need loss_scale='dynamic'"
                )
            self.scaler = None
        elif isinstance(loss_scale, int | float) and loss_scale > 0:
            # a static scale: the same policy object that never grows and never backs off
            self.scaler = DynamicLossScaler(
                init_scale=float(loss_scale), growth_interval=2**62, min_scale=float(loss_scale)
            )
        else:
            raise ValueError(f"loss_scale must be 'dynamic', a positive number or None, got "
                             f"{loss_scale!r}")  # fmt: skip
        self.skip_nonfinite = skip_nonfinite
        self.masters: MasterWeights | None = None
        self._initial: dict[int, Tensor] = {}
        self._params: list[nn.Parameter] = []
        self._pending_state: dict[str, Any] | None = None

    # ----------------------------------------------------------- model & input
    def convert_module(self, module: nn.Module) -> nn.Module:
        params = [p for p in module.parameters() if p.is_floating_point()]
        if self._params and {id(p) for p in params} == {id(p) for p in self._params}:
            return module  # a second setup (validate/test after fit): keep the masters
        self.masters = None  # a new model: new masters at connect
        self._initial = {id(p): p.detach().to(torch.float32).clone() for p in params}
        module = module.to(dtype=self.dtype)
        # ``Module.to`` swaps ``param.data`` in place, so the Parameter objects (and their ids)
        # are the ones the optimizer will be built from.
        self._params = [p for p in module.parameters() if p.is_floating_point()]
        return module

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(
            data, function=lambda t: t.to(self.dtype) if t.is_floating_point() else t, dtype=Tensor
        )

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Tensors created during forward default to the model's dtype (as HalfPrecision)."""
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    def fp32_values(self) -> dict[int, Tensor]:
        """``id(parameter) -> fp32 value`` before ``convert_module`` cast it down (empty once
        masters hold them): where masters a strategy keeps (:meth:`use_masters`) start from."""
        return dict(self._initial)

    def use_masters(self, masters: Any) -> None:
        """Step through ``masters`` instead of building a full fp32 copy at ``connect``: e.g.
        ZeRO's fp32 shards (:class:`~llmlab.parallel.data.zero_precision.ZeroMasterWeights`,
        same interface as :class:`MasterWeights`). Between ``convert_module`` and ``connect``;
        they must stand for parameters this plugin converted."""
        converted = {id(p) for p in self._params}
        if not converted or any(id(p) not in converted for p in masters.model_params):
            raise ValueError(
                "use_masters needs masters for parameters this plugin converted: call it after "
                "convert_module, with masters of that model"
            )
        self.masters = masters
        self._initial = {}  # the masters own the fp32 values now

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        if not self._params:  # convert_module was not called (a strategy that skips it)
            self.convert_module(model)
        if self.masters is None:
            self.masters = MasterWeights(
                self._params, self.scaler, self._initial, skip_nonfinite=self.skip_nonfinite
            )
            self._initial = {}  # the masters own the fp32 values now
        for opt in optimizers:  # again for validate/test after fit: a no-op then
            self.masters.rewire(opt)
        if self._pending_state is not None:
            self.masters.load_state_dict(self._pending_state)
            self._pending_state = None
        return model, optimizers, lr_schedulers

    # ----------------------------------------------------------------- backward
    def scale_loss(self, loss: Tensor) -> Tensor:
        """``S · loss`` (identity before ``connect`` or without a scaler): what every backward
        must start from. A pipeline engine, which runs one backward per micro-batch inside the
        training step instead of Lightning's one, calls this for each of them."""
        return self.masters.scale_loss(loss) if self.masters is not None else loss

    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        return super().pre_backward(self.scale_loss(tensor), module)

    def optimizer_step(
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self.masters is None:
            raise RuntimeError("MasterWeightPrecision.optimizer_step before connect()")
        closure_result = closure()  # forward + scaled backward on the low-precision model
        if closure_result is None and getattr(model, "automatic_optimization", True):
            # training_step returned None: Lightning skipped backward, nothing to step
            return closure_result
        found_inf = self.masters.unscale()
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, grad clipping
        self.masters.step(optimizer, found_inf, **kwargs)
        self._log(model)
        return closure_result

    def _log(self, model: Any) -> None:
        metrics = {
            "precision/loss_scale": self.masters.loss_scale,
            "precision/skipped_steps": float(self.masters.skipped_steps),
        }
        try:  # inside LightningModule.optimizer_step, where self.log is allowed
            for key, value in metrics.items():
                model.log(key, value, on_step=True, on_epoch=False, batch_size=1)
        except (MisconfigurationException, AttributeError, RuntimeError):
            trainer = getattr(model, "_trainer", None)
            if trainer is not None and trainer.logger is not None and trainer.is_global_zero:
                trainer.logger.log_metrics(metrics, step=trainer.global_step)

    # --------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        if self.masters is None:
            return {"scaler": self.scaler.state_dict() if self.scaler else None}
        return self.masters.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The scaler, and the masters when the state holds them (a checkpoint whose model
        values are the masters -- sharded, or ZeRO's -- does not: its skipped-step count still
        comes back)."""
        if "masters" not in state_dict:
            if self.scaler is not None and state_dict.get("scaler") is not None:
                self.scaler.load_state_dict(state_dict["scaler"])
            if self.masters is not None and "skipped_steps" in state_dict:
                self.masters.skipped_steps = int(state_dict["skipped_steps"])
            return
        if self.masters is None:
            self._pending_state = state_dict
        else:
            self.masters.load_state_dict(state_dict)

    @property
    def skipped_steps(self) -> int:
        return self.masters.skipped_steps if self.masters is not None else 0


class FP16MasterPrecision(MasterWeightPrecision):
    """fp16 weights and compute, fp32 masters, dynamic loss scaling (``precision: fp16_master``).

    Defaults: DeepSpeed's fp16 config, read from :data:`llmlab.parallel.precision.scaler.DEFAULTS`
    (``init_scale=2**16``, ``growth_interval=1000``, ``hysteresis=2``, ``min_scale=1``).
    """

    def __init__(
        self,
        init_scale: float = SCALER_DEFAULTS["init_scale"],
        growth_factor: float = SCALER_DEFAULTS["growth_factor"],
        backoff_factor: float = SCALER_DEFAULTS["backoff_factor"],
        growth_interval: int = SCALER_DEFAULTS["growth_interval"],
        hysteresis: int = SCALER_DEFAULTS["hysteresis"],
        consecutive_hysteresis: bool = SCALER_DEFAULTS["consecutive_hysteresis"],
        min_scale: float = SCALER_DEFAULTS["min_scale"],
        at_min: Literal["clamp", "raise"] = SCALER_DEFAULTS["at_min"],
    ) -> None:
        super().__init__(
            "float16",
            "dynamic",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            min_scale=min_scale,
            at_min=at_min,
        )


class BF16MasterPrecision(MasterWeightPrecision):
    """Pure bf16 weights and compute with fp32 masters; no loss scale (bf16 has fp32's range)."""

    def __init__(self, skip_nonfinite: bool = True) -> None:
        super().__init__("bfloat16", None, skip_nonfinite=skip_nonfinite)


class FP8Precision(WholeModelClipping, Precision):
    """fp8 compute for the chosen Linear layers (:func:`convert_to_float8`); fp32 elsewhere.

    The weights stay fp32 Parameters, so the optimizer runs in fp32 with no master copy; only
    the matmul operands are quantised (e4m3 forward, e5m2 gradients) on every call.
    """

    precision = "32-true"

    def __init__(
        self,
        min_features: int = 128,
        exclude: Sequence[str] = ("*lm_head",),
        recipe: Literal["dynamic", "delayed"] = "dynamic",
        history_len: int = 16,
        backend: Literal["auto", "scaled_mm", "emulate"] = "auto",
    ) -> None:
        self.options = dict(
            min_features=min_features,
            exclude=tuple(exclude),
            recipe=recipe,
            history_len=history_len,
            backend=backend,
        )
        # fail on bad options now, not at setup
        Float8Linear(16, 16, recipe=recipe, history_len=history_len, backend=backend)
        self.converted: list[str] = []

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert the Linear layers the filter chooses; an fp8 run that converts nothing
        would train in fp32 without a word, so that is an error naming the filter."""
        already = [n for n, m in module.named_modules() if isinstance(m, Float8Matmul)]
        if already:  # a second setup (validate/test after fit): converted the first time
            self.converted = already
            return module
        self.converted = convert_to_float8(module, **self.options)
        if not self.converted:
            linear = sum(isinstance(m, nn.Linear) for m in module.modules())
            raise ValueError(
                f"precision=fp8 converted no layer of {type(module).__name__}: none of its "
                f"{linear} Linear layers has both features >= min_features="
                f"{self.options['min_features']} (and a multiple of 16) outside exclude="
                f"{list(self.options['exclude'])}; lower precision.plugin.min_features or use "
                f"another precision"
            )
        log.info("fp8: converted %d Linear layers: %s", len(self.converted), self.converted)
        return module
