"""GGUF block formats kept whole (services/runtime/model/quant/gguf_blocks.py): decoding them
equals the ``gguf`` package's reference (gguf.quants.dequantize) bit for bit.

Blocks of random bytes (every bit pattern of values, 6-bit scales and their packing) and blocks
quantized from real values; shapes with 1, 3 and 17 rows and several blocks per row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from services.runtime.model.quant.formats import QuantizedWeight, cat_rows, dequantize, part_specs
from services.runtime.model.quant.gguf_blocks import BLOCK_FORMATS
from tests.helpers.kquants import TYPES, quantize_blocks, random_blocks

SHAPES = ((1, 256), (3, 768), (17, 512))


def weight(fmt: str, blocks: np.ndarray) -> QuantizedWeight:
    return QuantizedWeight.from_parts(fmt, {"qweight": torch.from_numpy(blocks)}, 32)


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dequantize_is_the_gguf_reference_bit_for_bit(fmt, shape):
    n, k = shape
    rng = np.random.default_rng(n * k)
    for blocks in (random_blocks(n, k, fmt, rng), quantize_blocks(rng.standard_normal((n, k)) * 0.05, fmt)):
        w = weight(fmt, blocks)
        assert w.shape == (n, k) and w.group_size == BLOCK_FORMATS[fmt][0]
        expected = gguf_dequantize(blocks, TYPES[fmt]).reshape(n, k)
        assert np.array_equal(dequantize(w).numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_the_test_quantizer_rounds_to_nearby_values(fmt):
    """The helper that writes K-quant test files is a quantizer, not noise (its error is the
    format's: a few percent of the largest weight)."""
    values = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    got = dequantize(weight(fmt, quantize_blocks(values, fmt))).numpy()
    assert np.abs(got - values).max() < 0.07 * np.abs(values).max()


def test_whole_block_weights_fuse_by_rows_and_check_their_shape():
    rng = np.random.default_rng(2)
    a, b = random_blocks(3, 512, "q4_k", rng), random_blocks(5, 512, "q4_k", rng)
    fused = cat_rows([weight("q4_k", a), weight("q4_k", b)])
    assert fused.shape == (8, 512) and fused.parts().keys() == {"qweight"}
    assert torch.equal(dequantize(fused), torch.cat([dequantize(weight("q4_k", a)), dequantize(weight("q4_k", b))]))
    assert part_specs("q6_k", 4, 512, 32) == {"qweight": ((4, 420), torch.uint8)}
    with pytest.raises(ValueError, match=r"q4_k: in_features \(320\) must be a multiple of its block of 256"):
        part_specs("q4_k", 4, 320, 32)
    with pytest.raises(ValueError, match="q5_0 weights are read from GGUF files"):
        from services.runtime.model.quant.formats import quantize

        quantize(torch.randn(4, 64), "q5_0")
