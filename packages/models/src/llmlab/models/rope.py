"""Rotary position embeddings: the angles ``position · f_i`` and the frequency rescalings.

The base frequencies are ``f_i = θ^(-2i/D)`` for ``i < D/2`` (HF's "rotate half" pairs; see
``llmlab.kernels.rope``). Long-context checkpoints rescale them, computed exactly as
``transformers``' ``ROPE_INIT_FUNCTIONS`` do:

* ``linear`` (position interpolation): ``f_i / factor``.
* ``llama3`` (Llama 3.1 / 3.2): with wavelength ``λ_i = 2π / f_i`` and the original context
  ``L``, frequencies whose wavelength exceeds ``L / low_freq_factor`` are divided by ``factor``,
  those shorter than ``L / high_freq_factor`` are kept, and the band between blends the two with
  ``s = (L / λ_i - low) / (high - low)``: ``(1 - s) · f_i / factor + s · f_i``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device
) -> Tensor:
    """The (D/2,) fp32 RoPE frequencies, rescaled as ``scaling`` says (module docstring)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"rope_type={kind!r} is not implemented; valid: default, linear, llama3")


def _llama3(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, blended, scaled)


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
        self._inv_freq: dict[torch.device, Tensor] = {}

    def inv_freq(self, device: torch.device) -> Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = inverse_frequencies(
                self.head_dim, self.theta, self.scaling, device
            )
        return self._inv_freq[device]

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) of shape (positions.shape[0], T, D/2), in ``dtype`` (as HF casts them)."""
        angles = positions[..., None].float() * self.inv_freq(positions.device)
        return angles.cos().to(dtype), angles.sin().to(dtype)
