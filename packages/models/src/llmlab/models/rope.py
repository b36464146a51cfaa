"""Rotary position embeddings: the angles ``position · f_i`` and the frequency rescalings.

The base frequencies are ``f_i = θ^(-2i/D)`` for ``i < D/2`` (HF's "rotate half" pairs; see
``llmlab.kernels.rope``). Long-context checkpoints rescale them, computed exactly as
``transformers``' ``ROPE_INIT_FUNCTIONS`` do:

* ``linear`` (position interpolation): ``f_i / factor``.
* ``llama3`` (Llama 3.1 / 3.2): with wavelength ``λ_i = 2π / f_i`` and the original context
  ``L``, frequencies whose wavelength exceeds ``L / low_freq_factor`` are divided by ``factor``,
  those shorter than ``L / high_freq_factor`` are kept, and the band between blends the two with
  ``s = (L / λ_i - low) / (high - low)``: ``(1 - s) · f_i / factor + s · f_i``.
* ``yarn`` (YaRN, arXiv 2309.00071; DeepSeek-V3, Qwen's long-context recipe): dimensions that
  turn fewer than ``beta_slow`` times over the original context ``L`` are interpolated
  (``f_i / factor``), those that turn more than ``beta_fast`` times are kept, with a linear ramp
  between (over the pair index ``i``, the bounds ``D·ln(L / (2π·β)) / (2 ln θ)`` floored and
  ceiled unless ``truncate`` is false). The cos and sin tables are then multiplied by the
  *attention factor* ``attention_factor``, by default ``m(factor)`` with
  ``m(s) = 0.1 · ln(s) + 1`` (1 for ``s <= 1``), or ``m(factor, mscale) / m(factor,
  mscale_all_dim)`` with ``m(s, a) = 0.1 · a · ln(s) + 1`` when both are given: q·k of the
  rotated dimensions grows by its square. Multi-head latent attention also multiplies its
  softmax scale by ``m(factor, mscale_all_dim)²`` (:func:`softmax_scale`), as DeepSeek does.

``rope_interleave`` (DeepSeek's checkpoints) pairs dimensions ``(x_0, x_1), (x_2, x_3), ...``
instead of ``(x_i, x_{i+D/2})``: :func:`deinterleave` reorders them to the rotate-half layout
first (evens, then odds), which is what ``transformers``' ``apply_rotary_pos_emb_interleave``
computes; the q·k products are the same, so nothing else changes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

# rope_type -> (required keys, optional keys) of LlamaConfig.rope_scaling (besides rope_type)
ROPE_TYPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        (),
    ),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
}


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device
) -> Tensor:
    """The (D/2,) fp32 RoPE frequencies, rescaled as ``scaling`` says (module docstring)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    powers = theta ** (exponents / head_dim)
    inv_freq = 1.0 / powers
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    if kind == "yarn":
        return _yarn(powers, head_dim, theta, scaling)
    raise ValueError(f"rope_type={kind!r} is not implemented; valid: {', '.join(ROPE_TYPES)}")


def _llama3(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, blended, scaled)


def _yarn(powers: Tensor, dim: int, theta: float, scaling: dict[str, Any]) -> Tensor:
    """HF's ``_compute_yarn_parameters``, op for op (its inverse frequencies); ``powers`` are
    ``θ^(2i/D)``."""
    factor = scaling["factor"]
    context = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the pair index turning `rotations` times
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).to(powers.device)  # 1: extrapolate (keep f_i), 0: interpolate
    return (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor on the cos and sin tables (1 except for YaRN; module docstring)."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = (
        scaling["factor"],
        scaling.get("mscale"),
        scaling.get("mscale_all_dim"),
    )
    if mscale and all_dim:
        return float(_mscale(factor, mscale) / _mscale(factor, all_dim))
    return _mscale(factor)


def softmax_scale(scaling: dict[str, Any] | None, head_dim: int) -> float:
    """Multi-head latent attention's softmax scale: ``head_dim^-0.5``, times
    ``m(factor, mscale_all_dim)²`` under a scaling that gives ``mscale_all_dim`` (HF's
    ``yarn_apply_mscale``)."""
    scale = head_dim**-0.5
    if scaling and scaling.get("rope_type", "default") != "default":
        all_dim = scaling.get("mscale_all_dim", 0)
        if all_dim:
            m = _mscale(scaling["factor"], all_dim)
            scale = scale * m * m
    return scale


def deinterleave(x: Tensor) -> Tensor:
    """``(..., D)`` with pairs ``(x_0, x_1), (x_2, x_3), ...`` -> ``(x_0, x_2, ..., x_1, x_3,
    ...)``: the rotate-half layout of the same pairs."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class Rotary:
    """cos and sin of the RoPE angles, computed as HF does.

    Not an ``nn.Module`` on purpose: the inverse frequencies must stay fp32 when the model is
    cast to fp16/bf16 (``model.half()`` would round a buffer), so they live in a per-device cache
    that ``.to()`` never touches. The angles are recomputed per call from the positions: a
    (B or 1, T, D/2) product, negligible next to the projections.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.attention_factor = attention_factor(scaling)
        self._inv_freq: dict[torch.device, Tensor] = {}

    def inv_freq(self, device: torch.device) -> Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = inverse_frequencies(
                self.head_dim, self.theta, self.scaling, device
            )
        return self._inv_freq[device]

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) of shape (positions.shape[0], T, D/2), in ``dtype`` (as HF casts them),
        times the attention factor (YaRN's; 1 otherwise)."""
        angles = positions[..., None].float() * self.inv_freq(positions.device)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)
