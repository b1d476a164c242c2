"""KV blocks as bytes, in the pool's own layout: what one executor sends another.

A block is every layer's K and V for ``block_size`` tokens (and, in a quantized pool, their
fp16 scales): ``bytes_per_block`` of services/runtime/kv_cache.py exactly. ``read_blocks``
copies a run of blocks out of a pool as one byte string per layer, ``write_blocks`` copies
such bytes into other blocks of a pool of the same layout (``kv_layout``), so a prompt's KV
computed on one executor continues on another without being computed again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from services.runtime.kernels.kv_quant import ScaledCache
from services.runtime.kv_cache import KVCache, KVPool
from services.runtime.model.config import ModelConfig


def kv_layout(config: ModelConfig, block_size: int, kv_dtype: torch.dtype, model_dtype: torch.dtype) -> str:
    """Names everything two pools must share for their blocks to be interchangeable: the model
    (its config's fields, so two copies of one checkpoint agree), the pool's geometry and its
    storage dtype."""
    model = hashlib.sha256(repr(config).encode()).hexdigest()[:16]
    return (f"{model}:layers={config.num_layers}:kv_heads={config.num_kv_heads}:head_dim={config.head_dim}"
            f":block_size={block_size}:kv={str(kv_dtype).removeprefix('torch.')}"
            f":model_dtype={str(model_dtype).removeprefix('torch.')}")


def _tensors(pool: KVPool) -> tuple[torch.Tensor, ...]:
    """A pool's tensors as bytes, blocks first: values, then scales when quantized. Copied as
    uint8 views, since not every storage dtype has index kernels on every device (fp8)."""
    tensors = (pool.data, pool.scale) if isinstance(pool, ScaledCache) else (pool,)
    return tuple(t.view(torch.uint8) for t in tensors)


def read_blocks(cache: KVCache, block_ids: Sequence[int]) -> list[bytes]:
    """One byte string per layer (per slot of a page with KV groups): K then V of ``block_ids``
    in order (scales after each)."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=cache.layers[0][0].device)
    out = []
    for k, v in cache.slots:
        parts = [t.index_select(0, index).cpu().reshape(-1) for pool in (k, v) for t in _tensors(pool)]
        out.append(torch.cat(parts).numpy().tobytes())
    return out


def write_blocks(cache: KVCache, block_ids: Sequence[int], layers: Sequence[bytes]) -> None:
    """Copy what ``read_blocks`` made (of as many blocks) into ``block_ids``; raises ValueError
    when the sizes do not match this pool."""
    if len(layers) != len(cache.slots):
        raise ValueError(f"{len(layers)} layers of KV for a pool of {len(cache.slots)}")
    index = torch.tensor(list(block_ids), dtype=torch.long, device=cache.layers[0][0].device)
    for (k, v), data in zip(cache.slots, layers):
        tensors = [t for pool in (k, v) for t in _tensors(pool)]
        sizes = [len(block_ids) * t[0].nbytes for t in tensors]
        if sum(sizes) != len(data):
            raise ValueError(f"{len(data)} bytes of KV for {len(block_ids)} blocks of {sum(sizes) // len(block_ids)} "
                             f"bytes a layer")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        offset = 0
        for tensor, size in zip(tensors, sizes):
            part = raw[offset:offset + size].reshape(len(block_ids), *tensor.shape[1:])
            tensor.index_copy_(0, index, part.to(tensor.device))
            offset += size
