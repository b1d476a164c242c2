"""Quantized KV cache: int8 or fp8 (e4m3) values with one scale per token per kv head.

A quantized pool is a ``ScaledCache``: the values in the usual [num_blocks, block_size, KH, D]
layout, in int8 or torch.float8_e4m3fn, and beside them one fp16 scale per (slot, kv head),
[num_blocks, block_size, KH]. A slot's row of scales is contiguous and sits at the slot's own
index (slot * KH + head), like its values: a token's write stores KH consecutive scales, and a
kernel reading a block of one kv head reads scales from one contiguous span of block_size * KH
* 2 bytes, the span the block's other heads read too.

Why fp16 scales: with head_dim 64 an int8 row is 64 bytes, so a 4-byte scale would hold the
pool to 128 / 68 = 1.88x the tokens of bf16; a 2-byte scale gives 128 / 66 = 1.94x. The scale is
rounded to fp16 before the values are divided by it, so the values are quantized against the
very scale that dequantizes them (the round trip error stays within half a step).

The one quantization rule (every write path implements exactly this, tested against it):
  amax  = max over the head's D values of |x|                      (fp32)
  scale = fp16(clamp(amax / QMAX, MIN_SCALE, MAX_SCALE))
  int8: q = clamp(floor(x / scale + 0.5), -127, 127)               (symmetric, round half up)
  fp8:  q = float8_e4m3fn(clamp(x / scale, -448, 448))             (round to nearest even)
  dequantized x = float(q) * float(scale)
Round half up, not torch.round's half to even: Triton has floor but no portable rint, and the
torch, C++ and Triton writes must store the same bytes.

Attention kernels never materialize dequantized K/V: the K scale multiplies the q.k score of
its token after the dot product (int8 and e4m3 values are exact in fp16/bf16), and the V scale
multiplies the token's softmax weight before the weighted sum.

Imports only torch (the kernels import it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
"""Quantized storage by --kv-cache-dtype name ("auto" = unquantized, the model's dtype)."""
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
"""Largest stored magnitude: int8 symmetric (-127..127), e4m3fn's largest finite value."""
SCALE_DTYPE = torch.float16
MIN_SCALE = 2.0**-14
"""fp16's smallest normal: an all-zero head (amax 0) still divides by a finite nonzero scale."""
MAX_SCALE = 65504.0
"""fp16's largest finite value."""


@dataclass(slots=True, frozen=True)
class ScaledCache:
    """One quantized K (or V) pool of one layer. Shaped like a plain pool to the code that only
    sizes things (``shape``, ``device``); ``dtype`` is the storage dtype."""

    data: torch.Tensor
    """[num_blocks, block_size, KH, D] int8 or float8_e4m3fn."""
    scale: torch.Tensor
    """[num_blocks, block_size, KH] float16."""

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    @classmethod
    def empty(cls, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> "ScaledCache":
        if dtype not in QMAX:
            raise ValueError(f"quantized KV storage must be int8 or float8_e4m3fn, got {dtype}")
        return cls(torch.empty(shape, dtype=dtype, device=device),
                   torch.empty(shape[:3], dtype=SCALE_DTYPE, device=device))


def parse_kv_cache_dtype(name: str) -> torch.dtype | None:
    """None for "auto" (the model's dtype), else the quantized storage dtype."""
    if name == "auto":
        return None
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return KV_CACHE_DTYPES[name]


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (values [..., D] in ``dtype``, scales [...] fp16), by the rule above."""
    qmax = QMAX[dtype]
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = (amax / qmax).clamp(MIN_SCALE, MAX_SCALE).to(SCALE_DTYPE)
    y = x / scale.float().unsqueeze(-1)
    if dtype == torch.int8:
        values = torch.floor(y + 0.5).clamp(-127.0, 127.0).to(torch.int8)
    else:
        values = y.clamp(-qmax, qmax).to(dtype)
    return values, scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values [..., D], scale [...] -> [..., D] in ``dtype`` (products in fp32)."""
    return (values.float() * scale.float().unsqueeze(-1)).to(dtype)


def dequantize_cache(cache: "torch.Tensor | ScaledCache", dtype: torch.dtype) -> torch.Tensor:
    """A whole pool as a plain tensor in ``dtype`` (references and tests; a plain pool passes through)."""
    if isinstance(cache, ScaledCache):
        return dequantize(cache.data, cache.scale, dtype)
    return cache.to(dtype)


def write_quantized(k: torch.Tensor, v: torch.Tensor, k_cache: ScaledCache, v_cache: ScaledCache,
                    slot_mapping: torch.Tensor) -> None:
    """Quantize k, v [T, KH, D] into the pools at ``slot_mapping`` [T] (slots < 0 skipped), in torch."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache in ((k[keep], k_cache), (v[keep], v_cache)):
        values, scale = quantize(x, cache.dtype)
        kh, d = cache.shape[2], cache.shape[3]
        as_bytes(cache.data).view(-1, kh, d).index_copy_(0, slots, as_bytes(values))
        cache.scale.view(-1, kh).index_copy_(0, slots, scale)


def as_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp8 values viewed as uint8 (same bits): PyTorch's CPU index_copy_/index_select have no
    float8 kernels. Other dtypes pass through."""
    return values.view(torch.uint8) if values.dtype == torch.float8_e4m3fn else values


def gather_dequantized(cache: "torch.Tensor | ScaledCache", blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pool's blocks ``blocks`` [n] int64 as [n, BS, KH, D] in ``dtype`` (dequantized when
    quantized). index_select on the block dimension: several times faster than advanced
    indexing on a CPU."""
    if isinstance(cache, ScaledCache):
        data = as_bytes(cache.data).index_select(0, blocks).view(cache.dtype)
        return dequantize(data, cache.scale.index_select(0, blocks), dtype)
    return cache.index_select(0, blocks).to(dtype)
