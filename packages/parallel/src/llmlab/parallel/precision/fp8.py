"""fp8 Linear layers: e4m3 inputs and weights, e5m2 output gradients, per-tensor amax scales.

fp8 has so few bits that each tensor needs its own scale to use the range it has: with
``amax = max|x|`` and ``q = cast_fp8(clamp(x · s))``, ``s = FP8_MAX / amax`` maps the largest
entry onto the largest finite fp8 value (e4m3: 448, 3 mantissa bits, for the forward; e5m2:
57344, 2 mantissa bits but a wider range, for gradients). The product of two quantised operands
is ``(q_a @ q_b) / (s_a · s_b)``, exactly what ``torch._scaled_mm`` computes with
``scale_a = 1/s_a, scale_b = 1/s_b``.

Scaling recipes: *dynamic* uses the current tensor's amax (one extra reduction per tensor);
*delayed* uses the max over a history of the last ``history_len`` amaxes (Transformer Engine's
recipe), so the scale is known before the tensor is — values above it saturate at FP8_MAX.

Backends: ``"scaled_mm"`` multiplies the fp8 tensors with ``torch._scaled_mm``; ``"emulate"``
dequantises and multiplies in fp32 (the same rounding of the operands, an fp32 accumulation);
``"auto"`` picks ``scaled_mm`` on CUDA GPUs with fp8 tensor cores (sm89+), ``emulate`` elsewhere.
The optimizer and the weights themselves stay fp32: fp8 is compute only.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from llmlab.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
RECIPES = ("dynamic", "delayed")
BACKENDS = ("auto", "scaled_mm", "emulate")
EPS = 1e-12


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def scale_from_amax(amax: Tensor, dtype: torch.dtype) -> Tensor:
    """``s = FP8_MAX / amax`` as fp32 (amax clamped away from 0 so an all-zero tensor is fine)."""
    return (fp8_max(dtype) / amax.float().clamp(min=EPS)).to(torch.float32)


def quantize(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``cast(clamp(x · s, ±FP8_MAX))``: saturate rather than overflow to nan."""
    m = fp8_max(dtype)
    return (x.float() * scale).clamp(-m, m).to(dtype)


def dequantize(q: Tensor, scale: Tensor) -> Tensor:
    return q.to(torch.float32) / scale


class AmaxHistory(nn.Module):
    """The scale for one tensor role: from the current amax (dynamic) or a history (delayed)."""

    def __init__(self, dtype: torch.dtype, recipe: str, history_len: int) -> None:
        super().__init__()
        self.dtype = dtype
        self.recipe = recipe
        self.register_buffer("history", torch.zeros(history_len), persistent=True)

    def scale_for(self, x: Tensor) -> Tensor:
        amax = x.detach().abs().max().float()
        if self.recipe == "dynamic":
            return scale_from_amax(amax, self.dtype)
        hist = self.history
        known = hist.max()
        # First use: no history yet, so fall back to the current amax (no saturation at step 0).
        scale = scale_from_amax(torch.where(known > 0, known, amax), self.dtype)
        with torch.no_grad():
            hist.copy_(torch.roll(hist, 1))
            hist[0] = amax
        return scale


def _use_scaled_mm(backend: str, *tensors: Tensor) -> bool:
    if backend == "emulate":
        return False
    if backend == "scaled_mm":
        return True
    t = tensors[0]
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 9)


def _pad_inner(a: Tensor, b: Tensor, multiple: int = 16) -> tuple[Tensor, Tensor]:
    """``a`` (M, K) and ``b`` (K, N) with K padded by zeros to a multiple of ``multiple``: the
    same product. CUDA's ``_scaled_mm`` refuses other K; the features are multiples of 16
    (``Fp8Filter``), but the weight gradient's K is the token count (found on an H200: a
    backward of 21 tokens raised "trailing dimension of mat1 to be divisible by 16")."""
    pad = -a.shape[1] % multiple
    if not pad:
        return a, b
    a_padded = a.new_zeros(a.shape[0], a.shape[1] + pad)  # the form the H200 check ran
    a_padded[:, : a.shape[1]] = a
    b_padded = b.new_zeros(b.shape[0] + pad, b.shape[1])
    b_padded[: b.shape[0]] = b
    return a_padded, b_padded


def fp8_mm(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, backend: str) -> Tensor:
    """``dequant(a) @ dequant(b)`` for fp8 ``a`` (M, K) and ``b`` (K, N), in fp32."""
    if _use_scaled_mm(backend, a):
        a, b = _pad_inner(a, b)
        # _scaled_mm wants a row-major and b column-major; its scales multiply the result.
        b_col = b.t().contiguous().t()
        return torch._scaled_mm(
            a.contiguous(),
            b_col,
            scale_a=sa.reciprocal(),
            scale_b=sb.reciprocal(),
            out_dtype=torch.float32,
        )
    return dequantize(a, sa) @ dequantize(b, sb)


class _Fp8LinearFn(torch.autograd.Function):
    """y = x Wᵀ with x, W in e4m3; dY in e5m2 for both backward matmuls.

    Saves the fp8 x and W (1 byte per element instead of 4) and their scales.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, layer: Float8Matmul) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        sx = layer.input_amax.scale_for(x2)
        sw = layer.weight_amax.scale_for(weight)
        xq, wq = quantize(x2, sx, E4M3), quantize(weight, sw, E4M3)
        y = fp8_mm(xq, sx, wq.t(), sw, layer.backend)
        ctx.save_for_backward(xq, wq, sx, sw)
        ctx.layer = layer
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        xq, wq, sx, sw = ctx.saved_tensors
        layer: Float8Matmul = ctx.layer
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        sg = layer.grad_amax.scale_for(g2)
        gq = quantize(g2, sg, E5M2)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_mm(gq, sg, wq, sw, layer.backend).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = fp8_mm(gq.t(), sg, xq, sx, layer.backend)
        return grad_x, grad_w, None


def check_fp8_options(recipe: str, history_len: int, backend: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {list(RECIPES)}")
    if backend not in BACKENDS:
        raise ValueError(f"fp8 backend {backend!r} is not one of {list(BACKENDS)}")
    if not isinstance(history_len, int) or history_len < 1:
        raise ValueError(f"history_len must be a positive integer, got {history_len!r}")


class Float8Matmul(nn.Module):
    """What makes a Linear-like layer's matmul fp8: one amax history per tensor role.

    Mixed into ``nn.Linear`` (:class:`Float8Linear`) and into the tensor-parallel Linear layers
    (:class:`Float8ColumnParallelLinear`, :class:`Float8RowParallelLinear`), where it quantises
    the *local shard* in their ``local_linear`` seam, so the collectives around the product are
    the same ones as in fp32. The state_dict gains only the three amax histories.
    """

    input_amax: AmaxHistory
    weight_amax: AmaxHistory
    grad_amax: AmaxHistory
    recipe: str
    backend: str

    def _init_fp8(self, recipe: str, history_len: int, backend: str, device: Any = None) -> None:
        check_fp8_options(recipe, history_len, backend)
        self.recipe = recipe
        self.backend = backend
        with torch.device(device if device is not None else "cpu"):
            self.input_amax = AmaxHistory(E4M3, recipe, history_len)
            self.weight_amax = AmaxHistory(E4M3, recipe, history_len)
            self.grad_amax = AmaxHistory(E5M2, recipe, history_len)

    def fp8_linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        y = _Fp8LinearFn.apply(x, weight, self)
        return y if bias is None else y + bias.to(y.dtype)

    def _fp8_repr(self) -> str:
        return f"recipe={self.recipe}, backend={self.backend}"


class Float8Linear(Float8Matmul, nn.Linear):
    """An ``nn.Linear`` whose matmuls run in fp8; the weight and bias are fp32 Parameters.

    Build it with :meth:`from_linear` to *share* an existing layer's Parameters (so optimizers,
    tied weights and checkpoints keep working: the state_dict gains only the amax histories).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: Literal["dynamic", "delayed"] = "dynamic",
        history_len: int = 16,
        backend: Literal["auto", "scaled_mm", "emulate"] = "auto",
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias, device=device, dtype=dtype)
        self._init_fp8(recipe, history_len, backend, device=self.weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs: Any) -> Float8Linear:
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None, **kwargs)
        new.weight = linear.weight
        new.bias = linear.bias
        for amax in (new.input_amax, new.weight_amax, new.grad_amax):
            amax.history = torch.zeros_like(amax.history, device=linear.weight.device)
        return new

    def forward(self, x: Tensor) -> Tensor:
        return self.fp8_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, {self._fp8_repr()}"


class _Float8Parallel(Float8Matmul):
    """fp8 for a tensor-parallel Linear, made from the sharded layer: a module of the fp8 class
    sharing that layer's module state (the very same Parameters, process group and hooks),
    which replaces it in its parent."""

    @classmethod
    def from_parallel(cls, layer: nn.Module, **kwargs: Any) -> nn.Module:
        fp8 = cls.__new__(cls)
        fp8.__dict__.update(vars(layer))  # nn.Module keeps its whole state in __dict__
        fp8._init_fp8(device=layer.weight.device, **kwargs)
        return fp8

    def local_linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return self.fp8_linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._fp8_repr()}"


class Float8ColumnParallelLinear(_Float8Parallel, ColumnParallelLinear):
    """``ColumnParallelLinear`` with its local ``x W_iᵀ`` in fp8 (scales of the local shard)."""


class Float8RowParallelLinear(_Float8Parallel, RowParallelLinear):
    """``RowParallelLinear`` with its partial ``X_i W_iᵀ`` in fp8, before the sum over ranks."""


@dataclass(frozen=True)
class Fp8Filter:
    """Which Linear layers become fp8: big enough to gain, and not excluded by name.

    ``min_features``: both ``in_features`` and ``out_features`` must reach it (a small GEMM is
    bound by the extra quantise passes, not by the matmul); fp8 GEMMs also need both divisible
    by 16. ``exclude``: fnmatch patterns on module names (the LM head by default: its logits
    feed the softmax, where fp8's 3 mantissa bits cost the most).

    Tensor-parallel layers are judged by their *full* sizes (so every layout converts the same
    layers as one process does) and by their *local* weight for the multiple of 16 (that is the
    GEMM that runs).
    """

    min_features: int = 128
    exclude: Sequence[str] = ("*lm_head",)

    def __call__(self, name: str, module: nn.Module) -> bool:
        if fp8_maker(module) is None:
            return False
        if any(fnmatch.fnmatchcase(name, pat) for pat in self.exclude):
            return False
        full = (module.in_features, module.out_features)
        local = tuple(module.weight.shape)
        return all(d >= self.min_features for d in full) and all(d % 16 == 0 for d in local)


# The layer types fp8 knows, and how each becomes fp8 (sharing the original's Parameters).
FP8_LAYERS: dict[type[nn.Module], Any] = {
    nn.Linear: Float8Linear.from_linear,
    ColumnParallelLinear: Float8ColumnParallelLinear.from_parallel,
    RowParallelLinear: Float8RowParallelLinear.from_parallel,
}


def fp8_maker(module: nn.Module) -> Any:
    """How ``module`` becomes fp8 (``FP8_LAYERS``), or None. A subclass of ``nn.Linear`` whose
    class says ``plain_linear = True`` (the models' linear layer: only where its product runs
    differs) converts as ``nn.Linear``; other subclasses (an adapter, an fp8 layer) do not."""
    maker = FP8_LAYERS.get(type(module))
    if maker is None and isinstance(module, nn.Linear) and getattr(module, "plain_linear", False):
        return Float8Linear.from_linear
    return maker


def convert_to_float8(
    model: nn.Module,
    min_features: int = 128,
    exclude: Sequence[str] = ("*lm_head",),
    recipe: Literal["dynamic", "delayed"] = "dynamic",
    history_len: int = 16,
    backend: Literal["auto", "scaled_mm", "emulate"] = "auto",
) -> list[str]:
    """Make the chosen Linear layers of ``model`` fp8, in place: ``nn.Linear`` becomes
    :class:`Float8Linear`, a tensor-parallel Column/RowParallelLinear its fp8 subclass.

    Returns the names of the converted modules (empty when the filter leaves none; the
    precision plugin, which was asked for fp8, turns that into an error).
    """
    keep = Fp8Filter(min_features, tuple(exclude))
    chosen = [(n, m) for n, m in model.named_modules() if keep(n, m)]
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        fp8 = fp8_maker(linear)(linear, recipe=recipe, history_len=history_len, backend=backend)
        if fp8 is not linear:
            setattr(parent, child, fp8)
    return [n for n, _ in chosen]
