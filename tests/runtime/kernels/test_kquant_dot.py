"""The K-quant / q5_0 / q5_1 int8-activation kernels (services/runtime/kernels/cpu/kquant_dot.cpp)
against their PyTorch reference (services/runtime/kernels/kquant_act.py), on every instruction
set this CPU runs (and, through test_cpu_kernels_avx2.py, in a -march=haswell build).

Activations are quantized bit for bit as the reference does; the products' integer sums are
exact, so they differ from the reference's float64 only by fp32 rounding. Shapes are awkward:
1-67 rows (4 or 2 at a time in the kernels), output counts leaving a partial tile of 16 and a
half tile of 8, one to three super-blocks of 256 (q5_0/q5_1: blocks of 32, K = 96)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.runtime.kernels import cpu
from services.runtime.kernels.kquant_act import KQUANT_FORMAT_CODES, kquant_matmul_reference, pack_tiles
from services.runtime.kernels.quant_act import quantize_activations
from services.runtime.model.quant.formats import QuantizedWeight, dequantize
from services.runtime.model.quant.linear import QuantLinear, build_linear
from tests.helpers.kquants import quantize_blocks, random_blocks

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels cannot be built here")

FORMATS = tuple(KQUANT_FORMAT_CODES)
ROWS = (1, 2, 3, 5, 8, 67)
SHAPES = ((1, 256), (17, 512), (40, 768))


@pytest.fixture(params=cpu.supported_isas() if cpu.available() else ("portable",))
def isa(request):
    previous = cpu.set_isa(request.param)
    yield request.param
    cpu.set_isa(previous)


def weight(fmt: str, blocks: np.ndarray) -> QuantizedWeight:
    return QuantizedWeight.from_parts(fmt, {"qweight": torch.from_numpy(blocks)}, 32)


def kquant_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return torch.ops.tokenmill_quant.kquant_matmul(x, pack_tiles(w), KQUANT_FORMAT_CODES[w.fmt], *w.shape)


def assert_matches_reference(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=2e-6 * expected.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("block", [32, 256])
def test_quantized_activations_equal_the_reference_bitwise(isa, block):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 768, generator=gen) * torch.logspace(-3, 3, 768)
    x[2, 256:512] = 0
    x[3, :256] = 1e-39  # below fp32's smallest normal: zeros, not an infinite 127 / amax
    # 127 / 3.241004 times 0.5997134 is exactly 23.5 in fp32: half to even gives 24. torch's
    # ``127 / amax`` (a reciprocal, then a product) made it 23.4999 once.
    x[4, 512:768] = 0
    x[4, 512], x[4, 650] = 3.241004228591919, 0.5997133851051331
    q, d, bsum = torch.ops.tokenmill_quant.kquant_quantize_activations(x, block)
    rq, rd, _ = quantize_activations(x, block)
    assert torch.equal(q, rq) and torch.equal(d, rd)
    assert torch.equal(bsum, rq.int().view(9, -1, 16).sum(-1))
    if block == 256:
        assert q[4, 650] == 24


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kquant_product_equals_the_reference(isa, fmt, shape):
    n, k = shape
    if fmt in ("q5_0", "q5_1"):
        k = k * 3 // 8  # 96, 192, 288: blocks of 32, not of 256
    rng = np.random.default_rng(n * k)
    gen = torch.Generator().manual_seed(n * k)
    for w in (weight(fmt, quantize_blocks(rng.standard_normal((n, k)) * 0.05, fmt)),
              weight(fmt, random_blocks(n, k, fmt, rng))):  # every bit pattern of values and scales
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            assert_matches_reference(kquant_matmul(x, w), kquant_matmul_reference(x, w))


def test_rows_do_not_depend_on_their_batch(isa):
    """Each row is quantized and summed alone: the same bits at any batch size."""
    w = weight("q4_k", random_blocks(33, 512, "q4_k", np.random.default_rng(3)))
    x = torch.randn(11, 512)
    alone = torch.cat([kquant_matmul(x[i:i + 1], w) for i in range(11)])
    assert torch.equal(kquant_matmul(x, w), alone)


@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_is_close_to_the_exact_product(fmt):
    """Not the kernel's bound (the reference is): the rule is the intended one, within the ~1% of
    the output scale 8-bit activations cost."""
    k = 512 if fmt.endswith("_k") else 96
    w = weight(fmt, quantize_blocks(np.random.default_rng(4).standard_normal((48, k)) * 0.05, fmt))
    x = torch.randn(4, k)
    exact = x @ dequantize(w).t()
    assert (kquant_matmul(x, w) - exact).abs().max() < 0.03 * exact.abs().max()


def test_quant_linear_runs_kept_blocks_on_the_kquant_path():
    rng = np.random.default_rng(5)
    q6 = weight("q6_k", random_blocks(24, 512, "q6_k", rng))
    layer = QuantLinear(q6)
    assert layer.prepare("int8") == "cpu_kquant"
    assert layer.quantized.qweight.numel() == 0, "the stored blocks are dropped once repacked"
    assert layer.packed.numel() <= 1.0 * 32 * 2 * 210  # two tiles of 16, two super-blocks: the file's bytes
    x = torch.randn(6, 512)
    assert_matches_reference(layer(x), kquant_matmul_reference(x, q6))
    exact = QuantLinear(q6)
    assert exact.prepare("none") == "dequantized"
    reference = x @ dequantize(q6).t()
    torch.testing.assert_close(exact(x), reference, atol=1e-5 * reference.abs().max().item(), rtol=1e-5)
    # q|k|v of three formats: one product per format, side by side
    q, k = weight("q5_0", random_blocks(8, 512, "q5_0", rng)), weight("q4_k", random_blocks(4, 512, "q4_k", rng))
    stacked = build_linear([q, k, q6])
    for part in stacked.parts:
        assert part.prepare("int8") == "cpu_kquant"
    expected = torch.cat([kquant_matmul_reference(x, w) for w in (q, k, q6)], dim=-1)
    assert_matches_reference(stacked(x), expected)


def test_bad_inputs_are_refused():
    w = weight("q4_k", random_blocks(16, 256, "q4_k", np.random.default_rng(6)))
    packed = pack_tiles(w)
    with pytest.raises(RuntimeError, match="x must be \\[M, K\\] fp32"):
        torch.ops.tokenmill_quant.kquant_matmul(torch.randn(2, 128), packed, 0, 16, 256)
    with pytest.raises(RuntimeError, match="packed must be pack_tiles' tensor"):
        torch.ops.tokenmill_quant.kquant_matmul(torch.randn(2, 256), packed[:-1], 0, 16, 256)
    with pytest.raises(RuntimeError, match="format must be 0 \\(q4_k\\)"):
        torch.ops.tokenmill_quant.kquant_matmul(torch.randn(2, 256), packed, 7, 16, 256)
