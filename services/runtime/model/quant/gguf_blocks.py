"""GGUF's larger block formats kept as the file stores them: Q4_K, Q5_K, Q6_K (super-blocks of 256
values) and Q5_0, Q5_1 (blocks of 32), with their reference decoding.

Unlike q4_0/q4_1/q8_0 (formats.py), whose blocks are split into separate value and scale
tensors, these are kept whole: ``qweight`` [N, K / block * block_bytes] uint8 holds each row's
blocks byte for byte as in the file, and the loaded layer repacks them for its kernel. One
block per type (llama.cpp's ggml-common.h; offsets in bytes):

=====  =====  ===========================================================================
type   bytes  layout                                                  weight
=====  =====  ===========================================================================
q4_k   144    d, dmin fp16; 12 bytes of 6-bit sc[8], m[8]; 128 nibbles  d sc_s q - dmin m_s
q5_k   176    as q4_k, then 32 bytes of fifth bits, then the nibbles      d sc_s q - dmin m_s
q6_k   210    128 low nibbles, 64 bytes of 2 high bits, sc[16] int8, d    d sc_s (q - 32)
q5_0   22     d fp16, 4 bytes of fifth bits, 16 nibbles                   d (q - 16)
q5_1   24     d, m fp16, 4 bytes of fifth bits, 16 nibbles                d q + m
=====  =====  ===========================================================================

(s the sub-block of 32 values, 16 for q6_k). ``unpack`` turns blocks into natural-order integer
values and per-sub-block scales; ``dequantize`` computes the weight in fp32 with the same
operations, in the same order, as the ``gguf`` package's ``gguf.quants.dequantize`` (the
tests compare them bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_FORMATS = {"q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210), "q5_0": (32, 22), "q5_1": (32, 24)}
"""format -> (values per block, bytes per block)."""
SUB_BLOCK = {"q4_k": 32, "q5_k": 32, "q6_k": 16, "q5_0": 32, "q5_1": 32}
"""Values per scale."""
OFFSET = {"q6_k": 32, "q5_0": 16}
"""Subtracted from the stored unsigned value (the others keep it unsigned)."""
VALUE_BITS = {"q4_k": 4, "q5_k": 5, "q6_k": 6, "q5_0": 5, "q5_1": 5}


def row_bytes(fmt: str, in_features: int) -> int:
    block, size = BLOCK_FORMATS[fmt]
    return in_features // block * size


def in_features_of(fmt: str, row_bytes_: int) -> int:
    block, size = BLOCK_FORMATS[fmt]
    return row_bytes_ // size * block


@dataclass(frozen=True, slots=True)
class Unpacked:
    """One weight's blocks taken apart. N rows, K values, B = K / block, S = K / sub-block."""

    values: torch.Tensor
    """[N, K] uint8, the stored unsigned value (0 .. 2^bits - 1), before OFFSET."""
    d: torch.Tensor
    """[N, B] fp16: the block's scale."""
    dmin: torch.Tensor | None
    """[N, B] fp16: q4_k/q5_k's scale of the minimums; q5_1's minimum m itself."""
    sc: torch.Tensor | None
    """[N, S] int32: K-quants' integer sub-block scales (6-bit unsigned; q6_k: int8)."""
    m: torch.Tensor | None
    """[N, S] int32: q4_k/q5_k's 6-bit sub-block minimums."""

    def scale_offset(self, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 [N, S] scale and offset with weight = scale * (value - OFFSET) + offset.

        Both exact in fp32 (an fp16 times an integer below 2^8), and computed as gguf does."""
        n = self.values.shape[0]
        d = self.d.float()
        if self.sc is None:  # q5_0 / q5_1: one scale per block of 32
            return d, (self.dmin.float() if self.dmin is not None else None)
        per = self.sc.shape[1] // d.shape[1]
        scale = (d[:, :, None] * self.sc.view(n, -1, per).float()).view(n, -1)
        if self.m is None:
            return scale, None
        return scale, -(self.dmin.float()[:, :, None] * self.m.view(n, -1, per).float()).view(n, -1)


def _bits(byte: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """byte [..., 1, L] -> [..., len(shifts), L]: (byte >> shift) & mask for each shift."""
    return (byte.to(torch.int32) >> torch.tensor(shifts, dtype=torch.int32).view(-1, 1)) & mask


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes -> [n] fp16."""
    return raw.contiguous().view(torch.float16).reshape(raw.shape[0])


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 12] uint8 -> 6-bit sc, m [n, 8] (ggml's get_scale_min_k4)."""
    s = scales.to(torch.int32).view(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def unpack(fmt: str, qweight: torch.Tensor) -> Unpacked:
    """[N, row bytes] uint8 blocks -> values and scales (Unpacked)."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"{fmt!r} is not a GGUF block format ({', '.join(BLOCK_FORMATS)})")
    block, size = BLOCK_FORMATS[fmt]
    n = qweight.shape[0]
    blocks = qweight.reshape(-1, size)  # every block of every row, row-major
    nb = blocks.shape[0]
    if fmt in ("q4_k", "q5_k"):
        d, dmin = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
        sc, m = _k_scales(blocks[:, 4:16])
        qs = blocks[:, -128:]
        # 4 chunks of 32 bytes: low nibbles are sub-block 2i, high nibbles sub-block 2i + 1.
        values = _bits(qs.view(nb, 4, 1, 32), [0, 4], 0x0F).reshape(nb, 256)
        if fmt == "q5_k":  # bit s of byte j: the fifth bit of value j of sub-block s
            high = _bits(blocks[:, 16:48].view(nb, 1, 32), list(range(8)), 1).reshape(nb, 256)
            values = values | (high << 4)
        return Unpacked(values.to(torch.uint8).view(n, -1), d.view(n, -1), dmin.view(n, -1),
                        sc.reshape(n, -1), m.reshape(n, -1))
    if fmt == "q6_k":
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].view(torch.int8).to(torch.int32)
        d = _fp16(blocks[:, 208:210])
        low = _bits(ql.reshape(nb, 2, 1, 64), [0, 4], 0x0F).reshape(nb, 8, 32)
        high = _bits(qh.reshape(nb, 2, 1, 32), [0, 2, 4, 6], 0x03).reshape(nb, 8, 32)
        values = (low | (high << 4)).reshape(nb, 256)
        return Unpacked(values.to(torch.uint8).view(n, -1), d.view(n, -1), None, sc.reshape(n, -1), None)
    # q5_0 / q5_1: d (, m), 4 bytes of fifth bits (bit j: value j), 16 bytes: value j low, j + 16 high
    head = 2 if fmt == "q5_0" else 4
    d = _fp16(blocks[:, 0:2])
    dmin = _fp16(blocks[:, 2:4]) if fmt == "q5_1" else None
    qh = blocks[:, head:head + 4].contiguous().view(torch.int32).reshape(nb, 1)
    high = (qh >> torch.arange(32, dtype=torch.int32)) & 1
    low = _bits(blocks[:, head + 4:].view(nb, 1, 16), [0, 4], 0x0F).reshape(nb, 32)
    values = low | (high << 4)
    return Unpacked(values.to(torch.uint8).view(n, -1), d.view(n, -1),
                    None if dmin is None else dmin.view(n, -1), None, None)


def dequantize(fmt: str, qweight: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight in fp32, bit for bit gguf.quants.dequantize's."""
    u = unpack(fmt, qweight)
    n, k = u.values.shape
    scale, offset = u.scale_offset(fmt)
    sub = SUB_BLOCK[fmt]
    q = (u.values.to(torch.int32) - OFFSET.get(fmt, 0)).float().view(n, -1, sub)
    w = scale[:, :, None] * q
    if offset is not None:
        w = w + offset[:, :, None]  # q4_k: d sc q + (-(dmin m)), gguf's d sc q - dmin m
    return w.view(n, k)
