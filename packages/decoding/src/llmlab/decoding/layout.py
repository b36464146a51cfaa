"""Weight layouts for decoding one row at a time: the same values, a faster order in memory.

A decoding step at batch 1 multiplies one row ``x`` (1, in) by every weight matrix,
``y = x Wᵀ`` with ``W`` (out, in) stored row-major, as ``nn.Linear`` keeps it. The CPU BLAS
(MKL here) reads that product from either memory order of ``W``, but not equally fast, and no
simple rule says which wins: measured on the serving benchmark's GPT-2 (one thread), the LM head
(8192 × 256) takes 1.6 ms row-major and 0.7 ms column-major and the MLP's up-projection
(1024 × 256) 211 µs against 62 µs, while its down-projection (256 × 1024) is 3.5× faster
row-major. So :func:`tune_linear_layouts` measures both orders of every distinct weight shape on
this machine and stores each weight in the faster one (``W.t().contiguous().t()``: same shape,
same values, strides ``(1, out)``). Products of many rows (prefill, large batches) run at the
same speed either way (within ±10 % at 16 and 256 rows), so only the one-row case decides.

What changes is the layout only: results are the same product summed by a different BLAS
kernel (fp32 rounding differences, no more). A tied embedding table stored column-major is read
with a stride (a 256-token prompt's embedding lookup: 0.7 ms instead of 0.02 ms). CPU only:
cuBLAS reads both orders at full speed, so CUDA weights are left alone.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# (out, in, dtype, threads) -> whether column-major is faster: measured once per process.
_CHOICES: dict[tuple[int, int, torch.dtype, int], bool] = {}
COLD_BYTES = 4 << 20  # beyond a core's L2 (1 MiB here): where a decode step finds its weights
MIN_BYTES = 256 << 10  # smaller weights stay in the cache: either order is fast, keep the default


def _row_time_ratio(weight: Tensor, rounds: int = 5) -> float:
    """Median over interleaved rounds of (row-major time / column-major time) for one row.

    A decode step reads each weight once and then a dozen others, so the weight comes from
    beyond the core's private cache; timing one matrix in a loop (cache-hot) hides most of the
    difference. Each timing therefore cycles through copies that together exceed ``COLD_BYTES``.
    """
    in_features = weight.shape[1]
    nbytes = weight.numel() * weight.element_size()
    copies = min(32, max(1, -(-COLD_BYTES // nbytes)))
    rows = [weight.clone() for _ in range(copies)]
    columns = [w.t().contiguous().t() for w in rows]
    x = torch.ones(1, in_features, dtype=weight.dtype)
    sweeps = max(2, 16_000_000 // (nbytes * copies))  # each timing reads >= ~16 MB

    def seconds(ws: list[Tensor]) -> float:
        start = time.thread_time()
        for _ in range(sweeps):
            for w in ws:
                F.linear(x, w)
        return time.thread_time() - start

    seconds(rows), seconds(columns)  # first calls: page faults, BLAS set-up
    ratios = [seconds(rows) / max(seconds(columns), 1e-9) for _ in range(rounds)]
    return statistics.median(ratios)


def column_major_is_faster(weight: Tensor, min_gain: float = 1.1) -> bool:
    """Whether ``F.linear`` of one row reads ``weight``'s shape at least ``min_gain`` times faster
    column-major on this machine (measured on ``weight`` once per shape, dtype and thread count;
    near ties, and weights under ``MIN_BYTES``, keep the row-major default)."""
    if weight.numel() * weight.element_size() < MIN_BYTES:
        return False
    key = (*weight.shape, weight.dtype, torch.get_num_threads())
    if key not in _CHOICES:
        with torch.no_grad():
            _CHOICES[key] = _row_time_ratio(weight.detach()) >= min_gain
    return _CHOICES[key]


def tune_linear_layouts(model: nn.Module, min_gain: float = 1.1) -> list[str]:
    """Store every CPU ``nn.Linear`` weight of ``model`` in the memory order that multiplies
    one row faster here (see the module docstring); returns the names of the weights moved to
    column-major. Values, shapes and parameter identities (tied weights) are unchanged; calling
    it again changes nothing."""
    if min_gain < 1.0:
        raise ValueError(f"min_gain must be >= 1.0 (a speed-up factor), got {min_gain}")
    moved: list[str] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or not isinstance(weight, Tensor):
            continue
        if id(weight) in seen or weight.device.type != "cpu" or not weight.is_floating_point():
            continue
        seen.add(id(weight))
        if weight.dim() != 2 or weight.stride() != (weight.shape[1], 1):
            continue  # already column-major (tuned before), or a view we should not touch
        if column_major_is_faster(weight, min_gain):
            with torch.no_grad():
                weight.data = weight.data.t().contiguous().t()
            moved.append(f"{name}.weight" if name else "weight")
    return moved
