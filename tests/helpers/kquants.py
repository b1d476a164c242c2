"""K-quant test helpers: blocks of random bytes, and a real GGUF's tensors re-quantized to K-quants
(the quantizer itself is services/tools/kquants.py)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from services.tools.kquants import TYPES, quantize_blocks

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
