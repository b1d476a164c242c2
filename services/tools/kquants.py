"""A plain numpy quantizer to GGUF's Q4_K, Q5_K and Q6_K blocks, for test files and benchmarks.

The ``gguf`` package dequantizes K-quants but cannot quantize to them, so tests that need
K-quant tensors make them here: round to nearest with a min/max (q4_k, q5_k) or absmax (q6_k)
per sub-block, sub-block scales rounded to 6 (q6_k: 8) bits against the super-block's fp16
scale. Not llama.cpp's searching quantizer (its rounding is better), but every block it writes
is a valid block, which is what the decoders and kernels are tested on. Q5_0 and Q5_1 come
from ``gguf.quants.quantize``.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

TYPES = {"q4_k": GGMLQuantizationType.Q4_K, "q5_k": GGMLQuantizationType.Q5_K, "q6_k": GGMLQuantizationType.Q6_K,
         "q5_0": GGMLQuantizationType.Q5_0, "q5_1": GGMLQuantizationType.Q5_1}


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _minmax_blocks(x: np.ndarray, bits: int):
    """x [nb, 8, 32] -> d, dmin fp16 [nb], sc, m [nb, 8] in 0..63, q [nb, 8, 32] in 0..2^bits-1."""
    top = (1 << bits) - 1
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = x.max(axis=-1)
    scale = (hi - lo) / top
    mins = -lo
    d = _f16(scale.max(axis=-1) / 63)
    dmin = _f16(mins.max(axis=-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.int32)
        m = np.where(dminf > 0, np.rint(mins / dminf), 0).clip(0, 63).astype(np.int32)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint((x + (dminf * m)[..., None]) / step), 0).clip(0, top).astype(np.uint8)
    return d, dmin, sc, m, q


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """sc, m [nb, 8] 6-bit -> 12 bytes each (the inverse of ggml's get_scale_min_k4)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _quantize_k(x: np.ndarray, fmt: str) -> np.ndarray:
    nb = x.shape[0]
    if fmt in ("q4_k", "q5_k"):
        d, dmin, sc, m, q = _minmax_blocks(x.reshape(nb, 8, 32), 4 if fmt == "q4_k" else 5)
        low = (q & 15).reshape(nb, 4, 2, 32)
        qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
        parts = [d.reshape(nb, 1).view(np.uint8), dmin.reshape(nb, 1).view(np.uint8), _pack_k_scales(sc, m)]
        if fmt == "q5_k":  # bit s of byte j: the fifth bit of value j of sub-block s
            high = ((q >> 4) & 1).astype(np.uint8)  # [nb, 8, 32]
            parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8))
        return np.concatenate(parts + [qs], axis=-1)
    # q6_k: sub-blocks of 16 with a signed 8-bit scale, q - 32 in -32..31
    g = x.reshape(nb, 16, 16)
    idx = np.abs(g).argmax(axis=-1)[..., None]
    big = np.take_along_axis(g, idx, axis=-1)[..., 0]
    scale = big / -32
    d = _f16(np.abs(scale).max(axis=-1) / 127)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(-128, 127).astype(np.int32)
        step = (df * sc)[..., None]
        q = (np.where(step != 0, np.rint(g / step), 0) + 32).clip(0, 63).astype(np.uint8).reshape(nb, 8, 32)
    v = q.reshape(nb, 2, 4, 32)  # [half, group within the half, value]
    low = v & 15
    # ql[h * 64 + l]: low nibble = group h*4 + l // 32, high nibble = group h*4 + 2 + l // 32
    ql = (low[:, :, 0:2].reshape(nb, 2, 64) | (low[:, :, 2:4].reshape(nb, 2, 64) << 4)).reshape(nb, 128)
    high = (v >> 4) & 3  # qh[h * 32 + j] bits 2s: group h*4 + s
    qh = (high << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2).astype(np.uint8)
    return np.concatenate([ql, qh.reshape(nb, 64), sc.astype(np.int8).view(np.uint8),
                           d.reshape(nb, 1).view(np.uint8)], axis=-1)


def quantize_blocks(weight: np.ndarray, fmt: str) -> np.ndarray:
    """float [N, K] -> GGUF blocks [N, row bytes] uint8 of ``fmt`` (q4_k, q5_k, q6_k, q5_0, q5_1)."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if fmt in ("q5_0", "q5_1"):
        return gguf_quantize(weight, TYPES[fmt])
    n, k = weight.shape
    if k % 256:
        raise ValueError(f"{fmt}: K = {k} is not a multiple of 256")
    return _quantize_k(weight.reshape(-1, 256), fmt).reshape(n, -1)


def requantize_gguf(source, dest, type_of) -> None:
    """Copy the GGUF ``source`` to ``dest`` (metadata as it is) with each quantized tensor
    dequantized and quantized again to ``type_of(name, [out, in])`` (a GGMLQuantizationType, or
    None to keep the tensor's bytes): a real model's weights in K-quant blocks."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(source)
    writer = GGUFWriter(str(dest), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    for tensor in reader.tensors:
        qtype = GGMLQuantizationType(tensor.tensor_type)
        shape = tuple(int(n) for n in reversed(tensor.shape))
        target = type_of(tensor.name, shape) if qtype != GGMLQuantizationType.F32 else None
        if target is None:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=tensor.data.shape, raw_dtype=qtype)
            continue
        values = dequantize(tensor.data, qtype).reshape(shape)
        name = target.name.lower()
        blocks = quantize_blocks(values, name) if name in TYPES else gguf_quantize(values, target)
        writer.add_tensor(tensor.name, blocks, raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
