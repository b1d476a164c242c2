"""K-quant test helpers: blocks of random bytes (the quantizer and the GGUF re-quantizer are
services/tools/kquants.py, re-exported here)."""

from __future__ import annotations

import numpy as np

from services.tools.kquants import TYPES, quantize_blocks, requantize_gguf

__all__ = ["TYPES", "quantize_blocks", "random_blocks", "requantize_gguf"]


def random_blocks(n: int, k: int, fmt: str, rng: np.random.Generator) -> np.ndarray:
    """Blocks of random bytes with finite scales: every bit pattern of the values is exercised."""
    from services.runtime.model.quant.gguf_blocks import BLOCK_FORMATS

    block, size = BLOCK_FORMATS[fmt]
    raw = rng.integers(0, 256, size=(n * (k // block), size), dtype=np.uint8)
    scales = rng.uniform(-0.01, 0.01, size=(raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    if fmt == "q6_k":
        raw[:, 208:210] = scales[:, 0:2]
    else:
        raw[:, 0:2] = scales[:, 0:2]
        if fmt in ("q4_k", "q5_k", "q5_1"):
            raw[:, 2:4] = scales[:, 2:4]
    return raw.reshape(n, -1)
