"""``F.linear`` with llmlab's C++ kernel for fp32 products of a few rows on CPU (decoding).

Why: a decoding step multiplies one row of activations per sequence (``k + 1`` per sequence
when verifying ``k`` drafts) by every weight matrix, so its time is the time to read the
weights. MKL's sgemm reads them at about the rate a bandwidth-bound product can for one row,
at ~0.8x that rate for two or three rows and at less than half of it from four rows on
(measured on GPT-2 124M's matrices, one thread: 13-14 GB/s for one row, 6-7 for four, 4-5 for
eight). The kernel (``cpu/few_row_matmul.cpp``, AVX-512 or AVX2 + FMA) reads each weight vector
once for eight rows, and walks the weights in blocks that stay in cache while every tile of
eight rows passes over them: 1.4-3.2x MKL's speed at 4-12 rows on those matrices, 1.3-1.5x at
16, 1.0-1.05x at 1 row; from 24-32 rows on MKL's blocked GEMM is as fast or faster, so
:data:`MAX_ROWS` is 16. Each output is summed in the same order whatever the number of rows,
so a row's result does not depend on what it is batched with (MKL's does); the sums differ from
MKL's by fp32 rounding (~1e-7 relative).

When: plain fp32 CPU tensors (not subclasses such as DTensor), at most :data:`MAX_ROWS` rows of
``x`` once its leading dimensions are flattened, ``x`` and the weight contiguous, nothing that
needs a gradient (the kernel has no backward: training takes ``F.linear``), not under CPU
autocast (which would compute in bf16) nor under a dispatch mode (a FLOP counter would not see
the product), and the extension built (``LLMLAB_CPU_KERNELS=0`` turns it off). Everything else
is ``F.linear``'s. The models' linear layers (``llmlab.models.Linear``) call :func:`linear`.

Under ``torch.compile`` (the serving engine's compiled decode steps, ``generate(compile=True)``)
the same conditions are decided while tracing, on the graph's static shapes, and a product that
qualifies becomes one opaque op in the graph, ``llmlab::fp32_few_row_product`` (dynamo cannot
trace the pybind kernel); inductor would otherwise call MKL, at half the kernel's speed or less
from four rows on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from llmlab.kernels.cpu_extension import cpu_kernels

MAX_ROWS = 16  # beyond it MKL's blocked GEMM is faster (module docstring)
_PLAIN = (Tensor, torch.nn.Parameter)


def _needs_grad(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    return x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)


def kernel_applies(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether :func:`linear` computes ``x @ weight.T (+ bias)`` with the C++ kernel. The test
    that fails for a training step comes first: a training step pays the least here."""
    if torch.is_grad_enabled() and _needs_grad(x, weight, bias):
        return False
    if torch.compiler.is_compiling():
        return _traced_kernel_applies(x, weight, bias)
    width = x.shape[-1] if x.dim() else 0
    return (
        0 < x.numel() <= MAX_ROWS * width
        and type(x) is Tensor
        and type(weight) in _PLAIN
        and x.is_cpu
        and weight.is_cpu
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and width == weight.shape[1]
        and (bias is None or (type(bias) in _PLAIN and bias.dtype == torch.float32 and bias.is_cpu))
        and x.is_contiguous()
        and weight.is_contiguous()
        # autocast would run F.linear in bf16/fp16, and a dispatch mode (a FLOP counter, a
        # tracer) would see it: the kernel, an opaque call, would bypass both
        and not torch.is_autocast_enabled("cpu")
        and _get_current_dispatch_mode() is None
        and cpu_kernels() is not None
    )


def _traced_kernel_applies(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """:func:`kernel_applies` while dynamo traces: the same conditions on the graph's static
    shapes (a dynamic row count takes ``F.linear``: no guard is added on it), less those
    decided when the op runs (the extension built: else the op multiplies with ``torch.mm``) and
    the dispatch mode (dynamo traces none)."""
    rows = x.numel() // x.shape[-1] if x.dim() and isinstance(x.shape[-1], int) else None
    return (
        isinstance(rows, int)
        and 0 < rows <= MAX_ROWS
        and all(isinstance(n, int) for n in (*x.shape, *weight.shape))
        and type(weight) in _PLAIN
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and x.shape[-1] == weight.shape[1]
        and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu"))
        and weight.is_contiguous()
        and not torch.is_autocast_enabled("cpu")
    )


@torch.library.custom_op("llmlab::fp32_few_row_product", mutates_args=())
def _few_row_product_op(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` for (R <= MAX_ROWS, I) fp32 rows: the kernel, as one op of a compiled
    graph (module docstring)."""
    kernels = cpu_kernels()
    if kernels is None:
        return torch.mm(x, weight.t())
    return kernels.fp32_matmul(x.contiguous(), weight)


@_few_row_product_op.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``; fp32 CPU products of at most :data:`MAX_ROWS` rows without
    autograd through the C++ kernel (module docstring)."""
    if not kernel_applies(x, weight, bias):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        out = _few_row_product_op(flat, weight)
        out = out if bias is None else out + bias  # inductor fuses the add downstream
    else:
        out = cpu_kernels().fp32_matmul(flat, weight)
        if bias is not None:
            out.add_(bias)
    return out.view(*x.shape[:-1], weight.shape[0])
