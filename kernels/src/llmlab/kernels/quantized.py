"""Weight-only quantized products: ``x @ dequantize(W).T`` reading the packed bytes.

Formats (what ``llmlab.models.quantize`` stores):

* ``int8``: per output channel, ``w ≈ s_o · q`` with ``q`` in [-127, 127] and
  ``s_o = max_i |w_oi| / 127``; ``data`` (O, I) int8, ``scales`` (O,) fp32.
* ``int4`` with group ``g`` (32, 64, 128) along the input: ``w ≈ s_{o,j} · q`` with ``q`` in
  [-8, 7] and ``s`` per group the candidate step with the least squared error (``-m/8``,
  llama.cpp's Q4_0 rule for the group's value ``m`` of largest magnitude, to ``m/7``, the
  symmetric one: :func:`int4_scales`); two values per byte, stored as ``q + 8``:
  within a group, byte ``j`` holds value ``j`` in its low nibble and value ``j + g/2`` in its high
  nibble (no interleave to undo); ``data`` (O, I/2) uint8, ``scales`` (O, I/g) fp32.
* ``bf16``: the weights rounded to bfloat16; ``data`` (O, I) bf16, no scales, in tiles of
  ``BF16_TILE`` = 8 output rows, each tile stored chunk by chunk: chunk ``k`` holds the tile's
  rows' inputs ``[k C, k C + C)`` one row after another (``C`` = :func:`bf16_chunk` of the
  width: 1024, or the largest of 512 ... 64 dividing it). A decode step then reads each tile as
  one sequential stream whose pieces all meet the same ``C`` inputs of ``x`` (4 KiB, cached):
  on an AMD EPYC that read at ~0.85-0.93 of ``torch.sum``'s rate over the same bytes, where
  row-major weights read at ~0.75 of it.
  Rows past the last whole tile, and widths no chunk divides (``C = I``), are row-major.

Faces, as every op here: :func:`reference` (widen the weight, ``F.linear``: the oracle);
the CPU kernel (``cpu/few_row_matmul.cpp``, AVX-512 or AVX2 + FMA, every format: reads the
packed bytes and widens them in registers, each widened weight vector reused by up to four
rows of ``x``, bf16 tile by tile with every row of ``x`` passing a tile while it is cached;
built with llmlab's other C++ CPU kernels by :mod:`llmlab.kernels.cpu_extension`);
with AVX-512 VNNI, int8 and int4 products (widths a multiple of 128) instead round each row
of ``x`` to 16 bits per block of 128 inputs, split it into two 8-bit limbs and multiply them with
the packed weights exactly in ``vpdpbusd`` (error at most ``max|x_b| / 65278`` per input, ~3e-5
of the product's largest entry on Gaussian inputs, against ~1e-7 for the widening path), walking
the output rows one after another, up to four rows of ``x`` sharing each weight load; a row's
result is the same bits whatever rows it is batched with. On an AMD EPYC (Zen 4),
Llama-1B-shaped matrices in turn, 2 threads, one row of int8 read at 28-35 GB/s against 16-21
with eight output rows interleaved, int4 at ~20 GB/s of packed bytes (prefetching 2 KiB ahead)
against ~10 for the widening kernel (measured in one window each); sixteen rows of an
8192 x 2048 matrix took 2.80 ms against the widening kernel's 3.23 (int8) and 3.56 against 5.92
(int4, group 32; L3-hot, same run); and :func:`quantized_matmul`, which
dispatches: the kernel for fp32 CPU inputs where it is built, else a ``torch.compile``d
reduction over the packed bytes for one or two rows, else the reference. All compute
``x @ dequantize(W).T`` to fp32 rounding (their sums run in different orders; the VNNI paths to
the rounding of ``x`` above). An input that
requires grad goes through :class:`QuantizedMatmul` (the same faces forward; the backward
widens one layer's weight for ``grad_x`` and keeps nothing widened in between), the weight
frozen.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from llmlab.kernels.cpu_extension import cpu_kernels

KINDS = ("bf16", "int8", "int4")
BF16_TILE = 8  # output rows per tile of the bf16 layout
BF16_CHUNKS = (1024, 512, 256, 128, 64)  # inputs per chunk: the first that divides the width
INT4_GROUPS = (32, 64, 128)
COMPILED_ROWS = 2  # without the kernel, products of at most this many rows use the reduction


# ------------------------------------------------------------------------------ packing
def pack(weight: Tensor, kind: str, group: int | None = None) -> tuple[Tensor, Tensor | None]:
    """``(data, scales)`` of ``weight`` (O, I) in ``kind``'s layout (module docstring)."""
    if kind == "bf16":
        return _bf16_tiles(weight.detach()), None
    w = weight.detach().float()
    if kind == "int8":
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales
    out, inp = w.shape
    if group not in INT4_GROUPS or inp % group:
        raise ValueError(
            f"int4 needs a group in {INT4_GROUPS} dividing the input width {inp}, got {group}"
        )
    groups = w.view(out, inp // group, group)
    scales = int4_scales(groups)
    q = (torch.round(groups / scales[..., None]).clamp(-8, 7) + 8).to(torch.uint8)
    half = group // 2
    data = q[..., :half] | (q[..., half:] << 4)  # (out, in/g, g/2)
    return data.reshape(out, inp // 2).contiguous(), scales


def bf16_chunk(width: int) -> int:
    """Inputs per chunk of the bf16 layout for a width: the first of ``BF16_CHUNKS`` dividing it,
    else the width itself (the tiles are then row-major)."""
    return next((chunk for chunk in BF16_CHUNKS if width % chunk == 0), width)


def _bf16_tiled_rows(shape: torch.Size | tuple[int, int]) -> int:
    """How many leading rows of a bf16 ``data`` of ``shape`` lie in tiles (the rest: row-major)."""
    out, width = shape
    return out // BF16_TILE * BF16_TILE if bf16_chunk(width) < width else 0


def _bf16_tiles(weight: Tensor) -> Tensor:
    """``weight`` (O, I) rounded to bf16 in the tile layout; converted a block of tiles at a time,
    so that quantizing a layer holds one bf16 copy, not two."""
    out, width = weight.shape
    chunk, tiled = bf16_chunk(width), _bf16_tiled_rows(weight.shape)
    data = torch.empty(out, width, dtype=torch.bfloat16, device=weight.device)
    step = BF16_TILE * max(1, (1 << 22) // (BF16_TILE * width))  # ~4 Mi weights per block
    for start in range(0, tiled, step):
        rows = weight[start : min(start + step, tiled)]
        tiles = rows.reshape(-1, BF16_TILE, width // chunk, chunk).transpose(1, 2)
        data[start : start + rows.shape[0]] = tiles.reshape(rows.shape).to(torch.bfloat16)
    data[tiled:] = weight[tiled:]
    return data


def _bf16_row_major(data: Tensor) -> Tensor:
    """The (O, I) bf16 weight that tile-layout ``data`` holds, row-major."""
    width = data.shape[1]
    chunk, tiled = bf16_chunk(width), _bf16_tiled_rows(data.shape)
    if tiled == 0:
        return data
    tiles = data[:tiled].view(-1, width // chunk, BF16_TILE, chunk).transpose(1, 2)
    return torch.cat([tiles.reshape(tiled, width), data[tiled:]])


def take_rows(
    data: Tensor, scales: Tensor | None, kind: str, index: Tensor, dtype: torch.dtype
) -> Tensor:
    """Rows ``index`` (1-D) of the weight that ``data`` and ``scales`` stand for, in ``dtype``,
    without widening the others (an embedding's lookup). Branch-free: a compiled forward
    traces it with any index."""
    if kind != "bf16":
        return unpack(data[index], None if scales is None else scales[index], kind, dtype)
    out, width = data.shape
    chunk, tiled = bf16_chunk(width), _bf16_tiled_rows(data.shape)
    if tiled == 0:
        return data[index].to(dtype)
    tiles = data[:tiled].view(-1, width // chunk, BF16_TILE, chunk)
    in_tile = index.clamp(max=tiled - 1)
    rows = tiles[in_tile // BF16_TILE, :, in_tile % BF16_TILE].reshape(-1, width)
    if tiled < out:  # rows past the last tile: row-major
        rows = torch.where((index < tiled)[:, None], rows, data[index.clamp(min=tiled)])
    return rows.to(dtype)


# int4 step candidates, as fractions of the group's extreme value m: -m/8 is llama.cpp's Q4_0
# (m lands on -8 exactly, a value near -m is clamped to +7), m/7 the symmetric rule (m on +7),
# and between; each group keeps the one with the least squared error
INT4_STEPS = (-1 / 8, -1 / 7.5, 1 / 7.5, 1 / 7, -1 / 7)


def int4_scales(groups: Tensor) -> Tensor:
    """(O, I/g) scales of ``groups`` (O, I/g, g): per group, the candidate step (``INT4_STEPS``)
    whose rounding ``clamp(round(w / s), -8, 7) · s`` has the least squared error."""
    extreme = groups.gather(2, groups.abs().argmax(dim=2, keepdim=True)).squeeze(2)
    extreme = torch.where(extreme.abs() < torch.finfo(torch.float32).tiny, 1.0, extreme)
    best, best_error = None, None
    for fraction in INT4_STEPS:
        scale = extreme * fraction
        error = torch.round(groups / scale[..., None]).clamp(-8, 7) * scale[..., None] - groups
        error = error.square().sum(dim=2)
        if best is None:
            best, best_error = scale, error
        else:
            better = error < best_error
            best, best_error = torch.where(better, scale, best), torch.minimum(error, best_error)
    return best


def unpack(data: Tensor, scales: Tensor | None, kind: str, dtype: torch.dtype) -> Tensor:
    """The weight (O, I) that ``data`` and ``scales`` stand for, in ``dtype``."""
    if kind == "bf16":
        return _bf16_row_major(data).to(dtype)
    if kind == "int8":
        return (data.float() * scales[:, None]).to(dtype)
    out, groups = data.shape[0], scales.shape[1]
    nibbles = data.view(out, groups, -1)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=2).float() - 8  # (out, in/g, g)
    return (q * scales[..., None]).reshape(out, -1).to(dtype)


def reference(x: Tensor, data: Tensor, scales: Tensor | None, kind: str) -> Tensor:
    """``x @ dequantize(W).T`` by widening the whole weight: the oracle."""
    return F.linear(x, unpack(data, scales, kind, x.dtype))


# -------------------------------------------------------------- the compiled reduction
# x (R, I) against packed weights, summed in chunks of 256 inputs then over chunks: inductor
# vectorizes this form 1.5-3x better than one flat sum (measured on 2048 x 8192 int8).
def _int8_rows(x: Tensor, data: Tensor, scales: Tensor) -> Tensor:
    rows, (out, width) = x.shape[0], data.shape
    chunk = 256 if width % 256 == 0 else width
    return (x.view(rows, 1, -1, chunk) * data.view(out, -1, chunk)).sum(-1).sum(-1) * scales


def _bf16_rows(x: Tensor, data: Tensor, scales: Any) -> Tensor:
    rows, (out, width) = x.shape[0], data.shape
    chunk, tiled = bf16_chunk(width), _bf16_tiled_rows(data.shape)
    parts = []
    if tiled:
        tiles = data[:tiled].view(tiled // BF16_TILE, 1, width // chunk, BF16_TILE, chunk)
        xs = x.view(1, rows, width // chunk, 1, chunk)
        parts.append((xs * tiles).sum(-1).sum(2).transpose(0, 1).reshape(rows, tiled))
    if tiled < out:  # the row-major rest
        rest = data[tiled:].view(out - tiled, width // chunk, chunk)
        parts.append((x.view(rows, 1, width // chunk, chunk) * rest).sum(-1).sum(-1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _int4_rows(x: Tensor, data: Tensor, scales: Tensor, group: int) -> Tensor:
    # each byte's low nibble meets the first half of its group's inputs, the high nibble the
    # second half, scaled by its group's scale
    half, rows = group // 2, x.shape[0]
    groups = x.view(rows, -1, group)
    x_lo = groups[..., :half].reshape(rows, 1, -1)
    x_hi = groups[..., half:].reshape(rows, 1, -1)
    lo = (data & 15).to(torch.float32) - 8
    hi = (data >> 4).to(torch.float32) - 8
    return ((x_lo * lo + x_hi * hi) * scales.repeat_interleave(half, dim=1)).sum(-1)


# The group size must reach the compiler as a literal: passed through a closure or
# functools.partial it became a dynamic size and the kernel ran 50-100x slower (measured).
def _int4_g32(x: Tensor, data: Tensor, scales: Tensor) -> Tensor:
    return _int4_rows(x, data, scales, 32)


def _int4_g64(x: Tensor, data: Tensor, scales: Tensor) -> Tensor:
    return _int4_rows(x, data, scales, 64)


def _int4_g128(x: Tensor, data: Tensor, scales: Tensor) -> Tensor:
    return _int4_rows(x, data, scales, 128)


_EAGER = {"bf16": _bf16_rows, "int8": _int8_rows, 32: _int4_g32, 64: _int4_g64, 128: _int4_g128}
_COMPILED: dict[Any, Any] = {}


def compiled_rows(x: Tensor, data: Tensor, scales: Tensor | None, kind: str) -> Tensor:
    """The reduction over the packed bytes, compiled once per format (eager, with one warning,
    where compiling fails)."""
    key = kind if kind != "int4" else data.shape[1] * 2 // scales.shape[1]  # int4: its group
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(_EAGER[key], dynamic=True)
    try:
        return _COMPILED[key](x, data, scales)
    except Exception as err:  # no C++ compiler for inductor: the same product, eager
        warnings.warn(
            f"quantized products run eagerly (torch.compile failed: {err})",
            RuntimeWarning,
            stacklevel=2,
        )
        _COMPILED[key] = _EAGER[key]
        return _EAGER[key](x, data, scales)


# -------------------------------------------------------------------------- dispatch
def _cpu_product(flat: Tensor, data: Tensor, scales: Tensor | None, kind: str) -> Tensor:
    """(R, I) fp32 rows on a CPU times the packed weight -> (R, O): the C++ kernel where it is
    built, else the compiled reduction (one or two rows) or the reference."""
    kernel = cpu_kernels()
    if kernel is None:
        if flat.shape[0] <= COMPILED_ROWS:
            return compiled_rows(flat, data, scales, kind)
        return reference(flat, data, scales, kind)
    if kind == "int8":
        return kernel.int8_matmul(flat, data, scales)
    if kind == "int4":
        return kernel.int4_matmul(flat, data, scales, flat.shape[1] // scales.shape[1])
    return kernel.bf16_matmul(flat, data)


# The same product as one opaque op for torch.compile: dynamo cannot trace the pybind kernel
# (nor the build behind cpu_kernels), so a compiled graph calls this op, whose shape the fake
# below gives. Eager calls skip it: the dispatcher costs a few microseconds per call.
@torch.library.custom_op("llmlab::quantized_cpu_product", mutates_args=())
def _cpu_product_op(flat: Tensor, data: Tensor, scales: Tensor | None, kind: str) -> Tensor:
    return _cpu_product(flat, data, scales, kind)


@_cpu_product_op.register_fake
def _(flat: Tensor, data: Tensor, scales: Tensor | None, kind: str) -> Tensor:
    return flat.new_empty(flat.shape[0], data.shape[0])


def quantized_matmul(x: Tensor, data: Tensor, scales: Tensor | None, kind: str) -> Tensor:
    """``x @ dequantize(W).T`` for ``x`` (..., I), reading ``data`` (and ``scales``) in
    ``kind``'s layout (module docstring); the fastest face that applies (module docstring).
    Under ``torch.compile`` the CPU product is one opaque op (``llmlab::quantized_cpu_product``)
    and other devices take the reference, which the compiler fuses itself."""
    width = x.shape[-1]
    flat = x.reshape(-1, width)
    if torch.is_grad_enabled() and (x.requires_grad or _frozen_problem(data, scales)):
        return QuantizedMatmul.apply(x, data, scales, kind)
    compiling = torch.compiler.is_compiling()
    if x.device.type == "cpu" and x.dtype == torch.float32:
        product = _cpu_product_op if compiling else _cpu_product
        return product(flat.contiguous(), data, scales, kind).view(*x.shape[:-1], data.shape[0])
    if flat.shape[0] <= COMPILED_ROWS and not compiling:
        out = compiled_rows(flat.float(), data, scales, kind).to(x.dtype)
        return out.view(*x.shape[:-1], data.shape[0])
    return reference(x, data, scales, kind)


# -------------------------------------------------------------------------- autograd
def _frozen_problem(data: Tensor, scales: Tensor | None) -> bool:
    """Whether a packed buffer asks for a gradient (refused by :class:`QuantizedMatmul`)."""
    return data.requires_grad or (scales is not None and scales.requires_grad)


class QuantizedMatmul(torch.autograd.Function):
    """``x @ dequantize(W).T`` with a frozen packed ``W``, differentiable in ``x`` only
    (QLoRA's base): the forward is the packed product (no widened weight is built to be kept),
    and it saves only the packed buffers, which the module holds anyway; the backward widens
    ``W`` for one layer at a time, ``grad_x = grad_out @ dequantize(W)``, and drops it.
    Widening in the forward through ``F.linear`` instead would keep every layer's full-precision
    weight alive until the backward: the memory a quantized base was meant to save. ``W`` gets
    no gradient; packed buffers that ask for one are refused."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, data: Tensor, scales: Tensor | None, kind: str) -> Tensor:
        if _frozen_problem(data, scales):
            raise RuntimeError(
                "quantized_matmul: the packed weight (data/scales) requires grad; a quantized "
                "layer is frozen (integer codes have no gradient): train adapters beside it "
                "(llmlab.models.lora) or a float copy of the layer"
            )
        ctx.kind = kind
        ctx.save_for_backward(data, scales)
        return quantized_matmul(x, data, scales, kind)  # grad mode is off in here: no autograd

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, None, None]:
        data, scales = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        weight = unpack(data, scales, ctx.kind, grad_out.dtype)  # (O, I), this layer only
        return grad_out @ weight, None, None, None
