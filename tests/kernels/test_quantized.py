"""``llmlab.kernels.quantized``: every face computes ``x @ dequantize(W).T``.

The oracle is the weight widened by :func:`unpack` and multiplied in fp64; the CPU kernel (where
it builds: AVX2/AVX-512 and a compiler), the compiled reduction and the reference must each
equal it within 1e-4 of the product's largest entry (fp32 sums in their own orders), for every
format, row count (the kernel's tiles of 4, 2 and 1 rows and 8, 4, 2 and 1 output rows), and
widths that leave a tail of the cache-line loop: whole vectors, then single values. int8 and int4
products on AVX-512 VNNI (widths a multiple of 128) round each row of ``x`` to 16 bits per block of
128 inputs: tested against the bound that rounding implies, and each row's result is the same
bits whatever rows it is batched with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmlab.kernels import quantized
from llmlab.kernels.cpu_extension import cpu_kernels
from llmlab.kernels.quantized import compiled_rows, pack, quantized_matmul, unpack

FORMATS = [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128), ("bf16", None)]


def _oracle(x: torch.Tensor, data, scales, kind: str) -> torch.Tensor:
    return x.double() @ unpack(data, scales, kind, torch.float64).T


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(("kind", "group"), FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("tail", [8, 24])
def test_every_face_equals_the_widened_product(kind, group, rows, tail):
    torch.manual_seed(rows)
    # int8, bf16: 256 = whole cache lines, then `tail` inputs: 8 single values (264), or one
    # 16-wide vector and 8 single values (280)
    width = 256 if kind == "int4" else 256 + tail
    data, scales = pack(torch.randn(37, width), kind, group)  # 37 outputs: 8-, 4-, 2-, 1-row tiles
    x = torch.randn(rows, width)
    want = _oracle(x, data, scales, kind)
    assert _rel(quantized.reference(x, data, scales, kind), want) < 1e-4
    assert _rel(quantized_matmul(x, data, scales, kind), want) < 1e-4
    if rows <= 2:
        assert _rel(compiled_rows(x, data, scales, kind), want) < 1e-4
    kernel = cpu_kernels()
    if kernel is not None and kind == "int8":
        assert _rel(kernel.int8_matmul(x, data, scales), want) < 1e-4
    elif kernel is not None and kind == "int4":
        assert _rel(kernel.int4_matmul(x, data, scales, group), want) < 1e-4
    elif kernel is not None:
        assert _rel(kernel.bf16_matmul(x, data), want) < 1e-4


@pytest.mark.parametrize("width", [2048, 768, 320, 280])
def test_bf16_tiles_hold_the_rounded_weight_and_every_face_reads_them(width):
    """bf16 data lies in tiles of 8 output rows, each chunk by chunk (chunks of 1024 inputs at
    2048, 256 at 768, 64 at 320; 280 has no chunk: row-major), the rows past the last tile
    row-major: unpacking gives the weight rounded to bf16 exactly, every face equals the widened
    product, and the kernel's rows are the same bits whatever they are batched with."""
    torch.manual_seed(width)
    weight = torch.randn(37, width)  # four tiles, then 5 row-major rows
    data, _ = pack(weight, "bf16")
    rounded = weight.to(torch.bfloat16)
    assert torch.equal(unpack(data, None, "bf16", torch.bfloat16), rounded)
    chunk = quantized.bf16_chunk(width)
    assert chunk == {2048: 1024, 768: 256, 320: 64, 280: 280}[width]
    if chunk < width:  # tile 1, chunk 1, row 3 of the tile: output row 11's inputs [C, 2C)
        tiles = data[:32].view(4, width // chunk, 8, chunk)
        assert torch.equal(tiles[1, 1, 3], rounded[11, chunk : 2 * chunk])
    assert torch.equal(data[32:], rounded[32:])
    x = torch.randn(9, width)
    alone = torch.cat([quantized_matmul(x[i : i + 1], data, None, "bf16") for i in range(9)])
    for rows in (1, 2, 3, 5, 9):
        want = _oracle(x[:rows], data, None, "bf16")
        assert _rel(quantized.reference(x[:rows], data, None, "bf16"), want) < 1e-4
        assert _rel(compiled_rows(x[:rows], data, None, "bf16"), want) < 1e-4
        got = quantized_matmul(x[:rows], data, None, "bf16")
        assert _rel(got, want) < 1e-4
        if cpu_kernels() is not None:
            assert torch.equal(got, alone[:rows])


@pytest.mark.parametrize(("kind", "group"), FORMATS)
def test_take_rows_widens_exactly_the_rows_asked_for(kind, group):
    """An embedding's lookup (``take_rows``) gives the unpacked weight's rows: rows in bf16
    tiles and past them, repeated, in any order."""
    torch.manual_seed(2)
    data, scales = pack(torch.randn(37, 2048), kind, group)
    index = torch.tensor([36, 0, 11, 11, 33, 7, 31, 32])
    want = unpack(data, scales, kind, torch.float32)[index]
    assert torch.equal(quantized.take_rows(data, scales, kind, index, torch.float32), want)


def _vnni_built() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return cpu_kernels() is not None and "avx512_vnni" in flags and "avx512bw" in flags


# x's 16-bit step per block of 128 inputs: max|x_b| / QMAX (int4's limbs are both signed)
VNNI_QMAX = {"int8": 32767, "int4": 32639}


def _kernel_product(x, data, scales, kind: str, group) -> torch.Tensor:
    if kind == "int8":
        return cpu_kernels().int8_matmul(x, data, scales)
    return cpu_kernels().int4_matmul(x, data, scales, group)


@pytest.mark.skipif(
    not _vnni_built(), reason="no AVX-512 VNNI here: int8/int4 products take the exact path"
)
@pytest.mark.parametrize(
    ("kind", "group"), [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)]
)
@pytest.mark.parametrize("outliers", [False, True])
def test_vnni_products_round_x_to_16_bits_per_block_and_no_more(kind, group, outliers):
    """With AVX-512 VNNI an int8 or int4 product (widths a multiple of 128) rounds each row of
    ``x`` to 16 bits per block of 128 inputs (step ``max|x_b| / QMAX``) and multiplies exactly:
    its error is within the bound that rounding implies, ``sum_i |w_oi| * step_b(i) / 2`` (plus
    fp32 sums), and within 1e-4 of the product's largest entry even with outlier channels."""
    torch.manual_seed(3)
    width = 768
    data, scales = pack(torch.randn(300, width), kind, group)
    x = torch.randn(5, width)  # tiles of 4 rows and 1
    if outliers:
        x[:, 5] *= 50  # an outlier channel: its block's other inputs round 50x coarser
    want = _oracle(x, data, scales, kind)
    got = _kernel_product(x, data, scales, kind, group)
    step = x.view(5, -1, 128).abs().amax(dim=2).repeat_interleave(128, dim=1).double()
    step /= VNNI_QMAX[kind]
    bound = (step @ unpack(data, scales, kind, torch.float64).abs().T) / 2
    err = (got.double() - want).abs()
    assert bool((err <= bound + 1e-6 * want.abs().max()).all())
    assert _rel(got, want) < 1e-4
    # an inf or NaN in x takes the widening path, which carries it to the output
    for bad in (float("nan"), float("inf")):
        x_bad = x[:1].clone()
        x_bad[0, 7] = bad
        assert not bool(_kernel_product(x_bad, data, scales, kind, group).isfinite().any())
    # a block of subnormal values (its step's inverse overflows fp32) takes the widening path
    x_tiny = x * 1e-39
    want_tiny = _oracle(x_tiny, data, scales, kind)
    assert _rel(_kernel_product(x_tiny, data, scales, kind, group), want_tiny) < 1e-4


@pytest.mark.skipif(not _vnni_built(), reason="no AVX-512 VNNI here: the exact path is tested")
@pytest.mark.parametrize(("kind", "group"), [("int8", None), ("int4", 32), ("int4", 128)])
def test_vnni_rows_give_the_same_bits_whatever_they_are_batched_with(kind, group):
    """Rows share only the weights they read: a row's result is the same bits alone, in tiles of
    4, 2 or 1 rows, and beside a row that takes the widening path (a NaN: that row alone is
    NaN). So a quantized model decodes the same tokens batched, verifying drafts or alone."""
    torch.manual_seed(5)
    data, scales = pack(torch.randn(200, 512), kind, group)
    x = torch.randn(11, 512)
    alone = torch.cat([_kernel_product(x[i : i + 1], data, scales, kind, group) for i in range(11)])
    for rows in (2, 3, 5, 8, 11):
        assert torch.equal(_kernel_product(x[:rows], data, scales, kind, group), alone[:rows])
    x[6, 100] = float("nan")
    mixed = _kernel_product(x, data, scales, kind, group)
    assert bool(mixed[6].isnan().all())
    keep = torch.arange(11) != 6
    assert torch.equal(mixed[keep], alone[keep])


def test_the_kernel_is_built_here():
    """This machine has a compiler and AVX2: the kernel must build (a silent fallback would
    leave every quantized product on the slow faces)."""
    assert cpu_kernels() is not None


def test_input_gradients_and_other_dtypes():
    data, scales = pack(torch.randn(16, 64), "int8")
    x = torch.randn(3, 64, requires_grad=True)
    quantized_matmul(x, data, scales, "int8").sum().backward()
    want = unpack(data, scales, "int8", torch.float32).sum(0).expand(3, 64)
    torch.testing.assert_close(x.grad, want)
    x64 = torch.randn(3, 64, dtype=torch.float64)
    assert quantized_matmul(x64, data, scales, "int8").dtype == torch.float64


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"int4 needs a group in \(32, 64, 128\) dividing"):
        pack(torch.randn(4, 48), "int4", 32)
    data, scales = pack(torch.randn(8, 64), "int8")
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_kernels().int8_matmul(torch.randn(2, 32), data, scales)


@pytest.mark.parametrize(("kind", "group"), FORMATS)
def test_input_gradients_equal_the_widened_reference_and_keep_no_widened_weight(kind, group):
    """``QuantizedMatmul``: ``grad_x`` equals the reference's (``F.linear`` on the widened
    weight, autograd) within fp32 rounding; the graph saves the packed buffers and nothing of
    the weight's full-precision size (the reference saves the widened (O, I) fp32 copy)."""
    data, scales = pack(torch.randn(48, 128), kind, group)
    x = torch.randn(5, 128, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad_out = torch.randn(5, 48)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = quantized_matmul(x, data, scales, kind)
    out.backward(grad_out)
    quantized.reference(x_ref, data, scales, kind).backward(grad_out)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    assert {t.data_ptr() for t in saved} <= {data.data_ptr(), getattr(scales, "data_ptr", int)()}
    packed = sum(t.numel() * t.element_size() for t in (data, scales) if t is not None)
    assert sum(t.numel() * t.element_size() for t in saved) <= packed < 48 * 128 * 4


def test_a_packed_weight_that_asks_for_a_gradient_is_refused():
    data, scales = pack(torch.randn(16, 64), "int8")
    scales.requires_grad_()
    with pytest.raises(RuntimeError, match="a quantized layer is frozen"):
        quantized_matmul(torch.randn(2, 64), data, scales, "int8")
