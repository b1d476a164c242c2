"""The int8-activation kernels (services/runtime/kernels/cpu/quant_dot.cpp) against their PyTorch
reference (services/runtime/kernels/quant_act.py), on every instruction set this CPU runs.

The activations' quantization must equal the reference bit for bit (the same fp32 operations,
the same round-half-to-even). The products' integer dot products are exact, so they may differ
from the reference (float64 sums) only by the order and rounding of fp32 sums: a few ulps of the
output's scale. Shapes are awkward on purpose: 1-67 rows (the kernels take 8 or 4 at a time),
output counts that leave a partial tile of 16 or a half tile of 8, K not a multiple of 256, and
an odd number of 32-value blocks.
"""

from __future__ import annotations

import pytest
import torch

from services.runtime.kernels import cpu
from services.runtime.kernels.quant_act import int8_matmul_reference, quantize_activations
from services.runtime.model.quant.formats import dequantize, quantize
from services.runtime.model.quant.linear import INT8_FORMAT_CODES, QuantLinear

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels cannot be built here")

FORMATS = ("q4_0", "q4_1", "q8_0")
ROWS = (1, 2, 3, 4, 5, 8, 9, 17, 33, 67)
SHAPES = ((1, 32), (5, 96), (16, 160), (17, 608), (31, 64), (97, 1536))  # (out, in): N % 16 and K % 256 awkward


def isas() -> tuple[str, ...]:
    return cpu.supported_isas() if cpu.available() else ("portable",)


@pytest.fixture(params=isas())
def isa(request):
    previous = cpu.set_isa(request.param)
    yield request.param
    cpu.set_isa(previous)


def packed(w):
    mins = w.mins if w.mins is not None else torch.empty(0, dtype=torch.float16)
    return torch.ops.tokenmill_quant.repack_int8(w.qweight, w.scales, mins, INT8_FORMAT_CODES[w.fmt])


def int8_matmul(x, w):
    return torch.ops.tokenmill_quant.quant_matmul_int8(x, packed(w), INT8_FORMAT_CODES[w.fmt], *w.shape)


def test_every_isa_this_cpu_has_is_runnable():
    assert cpu.isa() in cpu.ISAS and cpu.supported_isas()[0] == "portable"
    assert cpu.isa() == cpu.supported_isas()[-1], "the best instruction set is the default"


def test_quantized_activations_equal_the_reference_bitwise(isa):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(67, 608, generator=gen) * torch.logspace(-3, 3, 608)  # every block its own scale
    x[3, 32:64] = 0  # an all-zero block: d = 0, q = 0
    x[4, 64:96] = 1e-39  # below fp32's smallest normal: quantized as zero, not by an infinite 127 / amax
    x[5, :32] = torch.cat([torch.tensor([127.0]), torch.arange(31) - 15.5])  # scale 1: halves, rounded to even
    q, d, sums = torch.ops.tokenmill_quant.quantize_activations(x)
    rq, rd, rsums = quantize_activations(x)
    assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(sums, rsums)
    assert q.abs().max() == 127 and not q[3, 32:64].any() and not q[4, 64:96].any() and d[4, 2] == 0
    assert q[5, 1:9].tolist() == [-16, -14, -14, -12, -12, -10, -10, -8]  # -15.5 .. -8.5, half to even


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_int8_product_equals_the_reference(isa, fmt, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n * k)
    w = quantize(torch.randn(n, k, generator=gen) * 0.05, fmt)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        out = int8_matmul(x, w)
        expected = int8_matmul_reference(x, w)
        assert out.shape == (rows, n) and not out.isnan().any()
        torch.testing.assert_close(out, expected, atol=2e-6 * expected.abs().max().item(), rtol=1e-5)


def test_int8_product_reads_rows_through_their_stride(isa):
    """x as a column slice of a wider buffer: the row stride is not K."""
    w = quantize(torch.randn(40, 96) * 0.05, "q4_1")
    wide = torch.randn(9, 160)
    x = wide[:, 32:128]
    expected = int8_matmul_reference(x.contiguous(), w)
    torch.testing.assert_close(int8_matmul(x, w), expected, atol=2e-6 * expected.abs().max().item(), rtol=1e-5)


def test_rows_do_not_depend_on_their_batch(isa):
    """Each row is quantized and summed alone: its outputs are the same bits at any batch size."""
    w = quantize(torch.randn(33, 160) * 0.05, "q4_0")
    x = torch.randn(23, 160)
    alone = torch.cat([int8_matmul(x[i:i + 1], w) for i in range(23)])
    assert torch.equal(int8_matmul(x, w), alone)


def test_int8_is_close_to_the_exact_product():
    """Not a bound of the kernel (the reference is): a check that the rule is the intended one,
    within the ~1% of the output scale that 8-bit activations cost."""
    w = quantize(torch.randn(64, 576) * 0.05, "q4_1")
    x = torch.randn(4, 576)
    exact = x @ dequantize(w).t()
    assert (int8_matmul(x, w) - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "int8"])
def test_exact_kernel_equals_the_dequantized_product(isa, fmt):
    """The fp32-activation kernels (quant_matmul.cpp) on this instruction set, per-row and panels."""
    from services.runtime.model.quant.formats import bits
    from services.runtime.model.quant.linear import cpu_kernel_operands

    gen = torch.Generator().manual_seed(1)
    ops = torch.ops.tokenmill_quant
    for n, k, group in ((17, 96, 32), (33, 608, 32), (5, 256, 64)):
        w = quantize(torch.randn(n, k, generator=gen) * 0.05, fmt, **({} if fmt == "int8" else {"group_size": group}))
        scales, zeros, g = cpu_kernel_operands(w)
        for rows in (1, 3, 5, 9, 67):
            x = torch.randn(rows, k, generator=gen)
            expected = x @ dequantize(w).t()
            for out in (ops.quant_matmul(x, w.qweight, scales, zeros, bits(fmt), g),
                        ops.quant_matmul_panels(x, w.qweight, scales, zeros, bits(fmt), g, 16)):
                torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)
        assert torch.equal(ops.quant_dequantize(w.qweight, scales, zeros, bits(fmt), g), dequantize(w))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_linear_takes_the_int8_path(fmt):
    w = quantize(torch.randn(40, 96) * 0.05, fmt)
    layer = QuantLinear(w)
    assert layer.prepare("int8") == "cpu_int8"
    assert layer.quantized.qweight.numel() == 0, "the stored parts are dropped once repacked"
    x = torch.randn(6, 96)
    out = layer(x)
    expected = int8_matmul_reference(x, w)
    torch.testing.assert_close(out, expected, atol=2e-6 * expected.abs().max().item(), rtol=1e-5)


def test_formats_without_int8_kernels_keep_the_exact_path():
    for w in (quantize(torch.randn(40, 96), "int8"), quantize(torch.randn(40, 128), "q4_1", group_size=64)):
        layer = QuantLinear(w)
        assert layer.prepare("int8") == "cpu_kernel"
        x = torch.randn(3, w.in_features)
        torch.testing.assert_close(layer(x), x @ dequantize(w).t(), atol=1e-4, rtol=1e-5)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="activations must be one of none, int8"):
        QuantLinear(quantize(torch.randn(16, 32), "q4_0")).prepare("int4")
    with pytest.raises(ValueError, match="TOKENMILL_CPU_ISA / cpu isa must be one of portable, avx2, avx512_vnni"):
        cpu.set_isa("sse2")
    missing = [name for name in cpu.ISAS if name not in cpu.supported_isas()]
    if missing:
        with pytest.raises(ValueError, match="this CPU cannot run"):
            cpu.set_isa(missing[0])
