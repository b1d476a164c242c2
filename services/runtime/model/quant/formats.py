"""Weight-only quantization formats: what a quantized [N, K] weight is made of, and its reference dequantization.

Four formats split into parts (and GGUF's larger blocks kept whole, below), all quantized along the input (K) axis, so concatenating weights along the
output (N) axis, as the fused q|k|v and gate|up projections do, is concatenating their parts:

======  =========================  ===============================  =========================
format  values                     per group (``group_size`` of K)  weight
======  =========================  ===============================  =========================
q4_0    4-bit q in 0..15           scale d (fp16)                   d * (q - 8)
q4_1    4-bit q in 0..15           scale d, minimum m (fp16)        d * q + m
q8_0    int8 q                     scale d (fp16)                   d * q
int8    int8 q                     scale s per output row (fp32)    s * q  (per channel)
======  =========================  ===============================  =========================

q4_0, q4_1 and q8_0 are llama.cpp's GGUF block formats (groups of 32) stored as they are in a
GGUF file, only split into separate tensors: ``qweight`` holds the blocks' value bytes back to
back, so a 4-bit row of K values is K/2 bytes in which byte j of a group holds value j in its
low nibble and value j + 16 in its high nibble (GGUF's order, kept so a converted file's bytes
are the file's bytes). ``scales`` (and ``mins``) are [N, K / group_size].

The checkpoint stores, for a weight ``X.weight``: ``X.qweight``, ``X.scales`` and, for q4_1,
``X.mins``. GGUF's larger blocks (q4_k, q5_k, q6_k, q5_0, q5_1: gguf_blocks.py) are kept whole
instead, as ``X.qweight`` alone: [N, row bytes] uint8, each row's blocks as the file has them. config.json's ``quantization_config`` says which weights are quantized and how
(``QuantizationConfig``, config.py's neighbour in this package).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.runtime.model.quant import gguf_blocks
from services.runtime.model.quant.gguf_blocks import BLOCK_FORMATS

FORMATS = ("q4_0", "q4_1", "q8_0", "int8", *BLOCK_FORMATS)
GGUF_GROUP_SIZE = 32


def bits(fmt: str) -> int:
    return 4 if fmt in ("q4_0", "q4_1") else 8


def part_specs(fmt: str, out_features: int, in_features: int, group_size: int
               ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The stored tensors of one quantized weight: suffix -> (shape, dtype)."""
    check_shape(fmt, out_features, in_features, group_size)
    n, k = out_features, in_features
    if fmt in BLOCK_FORMATS:
        return {"qweight": ((n, gguf_blocks.row_bytes(fmt, k)), torch.uint8)}
    if fmt == "int8":
        return {"qweight": ((n, k), torch.int8), "scales": ((n,), torch.float32)}
    groups = k // group_size
    if fmt == "q8_0":
        return {"qweight": ((n, k), torch.int8), "scales": ((n, groups), torch.float16)}
    parts = {"qweight": ((n, k // 2), torch.uint8), "scales": ((n, groups), torch.float16)}
    if fmt == "q4_1":
        parts["mins"] = ((n, groups), torch.float16)
    return parts


def check_shape(fmt: str, out_features: int, in_features: int, group_size: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"quantization format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if fmt == "int8":
        return
    if fmt in BLOCK_FORMATS:
        block = BLOCK_FORMATS[fmt][0]
        if in_features % block:
            raise ValueError(f"{fmt}: in_features ({in_features}) must be a multiple of its block of {block} values")
        return
    if group_size <= 0 or group_size % 2 or in_features % group_size:
        raise ValueError(f"{fmt}: in_features ({in_features}) must be a multiple of group_size ({group_size}), "
                         "an even number")
    if bits(fmt) == 4 and group_size % 32:
        raise ValueError(f"{fmt}: group_size must be a multiple of 32 (the nibble order pairs j with j + 16); "
                         f"got {group_size}")


@dataclass(slots=True)
class QuantizedWeight:
    """One quantized [out_features, in_features] weight: its format and stored parts."""

    fmt: str
    out_features: int
    in_features: int
    group_size: int
    """Values per scale along K; in_features for ``int8`` (one scale per row); a GGUF block
    format's block (256 or 32)."""
    qweight: torch.Tensor
    scales: torch.Tensor | None = None
    """None for the GGUF block formats, whose scales are inside ``qweight``."""
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def parts(self) -> dict[str, torch.Tensor]:
        parts = {"qweight": self.qweight}
        if self.scales is not None:
            parts["scales"] = self.scales
        if self.mins is not None:
            parts["mins"] = self.mins
        return parts

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts().values())

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        moved = {name: t.to(device) for name, t in self.parts().items()}
        return QuantizedWeight(self.fmt, self.out_features, self.in_features, self.group_size, **moved)

    @classmethod
    def from_parts(cls, fmt: str, parts: dict[str, torch.Tensor], group_size: int) -> "QuantizedWeight":
        """Check the parts' shapes and dtypes against the format; the error names the part."""
        qweight = parts["qweight"]
        n = qweight.shape[0]
        if fmt in BLOCK_FORMATS:
            k, group_size = gguf_blocks.in_features_of(fmt, qweight.shape[1]), BLOCK_FORMATS[fmt][0]
        else:
            k = qweight.shape[1] * (2 if bits(fmt) == 4 else 1)
        group_size = k if fmt == "int8" else group_size
        for name, (shape, dtype) in part_specs(fmt, n, k, group_size).items():
            tensor = parts.get(name)
            if tensor is None:
                raise ValueError(f"{fmt} weight is missing its {name!r} tensor")
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(f"{fmt} {name} has shape {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}")
        return cls(fmt, n, k, group_size, qweight, parts.get("scales"), parts.get("mins"))


def cat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights along the output axis (fused q|k|v, gate|up): parts concatenate row-wise."""
    first = weights[0]
    for w in weights[1:]:
        if (w.fmt, w.in_features, w.group_size) != (first.fmt, first.in_features, first.group_size):
            raise ValueError(f"cannot fuse a {w.fmt} [{w.out_features}, {w.in_features}] weight (groups of "
                             f"{w.group_size}) with a {first.fmt} [{first.out_features}, {first.in_features}] one "
                             f"(groups of {first.group_size})")
    parts = {name: torch.cat([w.parts()[name] for w in weights]) for name in first.parts()}
    return QuantizedWeight(first.fmt, sum(w.out_features for w in weights), first.in_features, first.group_size,
                           **parts)


def unpack_values(w: QuantizedWeight) -> torch.Tensor:
    """The integer values as int32 [N, K] in natural order (0..15 for 4-bit, -128..127 for 8-bit)."""
    if bits(w.fmt) == 8:
        return w.qweight.to(torch.int32)
    n, k = w.shape
    blocks = w.qweight.view(n, k // 32, 16).to(torch.int32)  # byte j of a 32-value block
    low, high = blocks & 0x0F, blocks >> 4  # values j and j + 16
    return torch.cat([low, high], dim=-1).reshape(n, k)


def pack_values(q: torch.Tensor) -> torch.Tensor:
    """Inverse of ``unpack_values`` for 4-bit values: int [N, K] in 0..15 -> uint8 [N, K/2], GGUF order."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference: the [N, K] weight computed in fp32 (as gguf.quants does), cast to ``dtype``."""
    if w.fmt in BLOCK_FORMATS:
        return gguf_blocks.dequantize(w.fmt, w.qweight).to(dtype)
    q = unpack_values(w).float()
    if w.fmt == "int8":
        return (w.scales.float()[:, None] * q).to(dtype)
    n, k = w.shape
    q = q.view(n, k // w.group_size, w.group_size)
    d = w.scales.float()[:, :, None]
    if w.fmt == "q4_0":
        values = d * (q - 8)
    elif w.fmt == "q4_1":
        values = d * q + w.mins.float()[:, :, None]
    else:  # q8_0
        values = d * q
    return values.reshape(n, k).to(dtype)


def quantize(weight: torch.Tensor, fmt: str, group_size: int = GGUF_GROUP_SIZE) -> QuantizedWeight:
    """Round to nearest, group-wise (``int8``: per output row), from a float [N, K] weight.

    The GGUF formats round as llama.cpp's reference quantizer does (gguf.quants, which the tests
    compare against byte for byte at group size 32): scales computed in fp32, stored as fp16.
    """
    n, k = weight.shape
    if fmt in BLOCK_FORMATS:
        raise ValueError(f"{fmt} weights are read from GGUF files, not quantized here")
    group_size = k if fmt == "int8" else group_size
    check_shape(fmt, n, k, group_size)
    w = weight.detach().float().cpu()
    if fmt == "int8":
        scale = w.abs().amax(dim=1) / 127
        inv = torch.where(scale == 0, 0.0, 1 / scale)
        q = torch.round(w * inv[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(fmt, n, k, k, q, scale)
    g = w.view(n, k // group_size, group_size)
    if fmt == "q8_0":
        d = g.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, 0.0, 1 / d)
        # Half away from zero, as ggml's roundf (torch.round rounds half to even).
        scaled = g * inv
        q = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).to(torch.int8).view(n, k)
        return QuantizedWeight(fmt, n, k, group_size, q, d.squeeze(-1).half())
    if fmt == "q4_0":
        # The value of largest magnitude maps to -8, keeping its sign: d = max / -8.
        idx = g.abs().argmax(dim=-1, keepdim=True)
        d = torch.gather(g, -1, idx) / -8
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = torch.trunc(g * inv + 8.5).clamp(0, 15)
        return QuantizedWeight(fmt, n, k, group_size, pack_values(q.view(n, k)), d.squeeze(-1).half())
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d == 0, 0.0, 1 / d)
    q = torch.trunc((g - lo) * inv + 0.5).clamp(0, 15)
    return QuantizedWeight(fmt, n, k, group_size, pack_values(q.view(n, k)), d.squeeze(-1).half(),
                           lo.squeeze(-1).half())
