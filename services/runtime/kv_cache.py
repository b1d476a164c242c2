"""The paged KV pool: one K and one V tensor per layer, shaped [num_blocks, block_size, kv_heads, head_dim].

With a quantized KV cache (``kv_dtype`` int8 or float8_e4m3fn) each of them is a ``ScaledCache``
(services/runtime/kernels/kv_quant.py): the values in that dtype plus one fp16 scale per token
per kv head, and the block count from a byte budget counts both.

The executor owns this memory; the scheduler owns the accounting (which block ids each
sequence uses). The pool is sized once at start from a memory budget, and its size is
reported so the scheduler can build its block manager to match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.runtime.kernels.kv_quant import QMAX, SCALE_DTYPE, ScaledCache
from services.runtime.model.config import ModelConfig

KVPool = torch.Tensor | ScaledCache
"""One layer's K (or V) pool: a plain tensor, or values with scales when quantized."""


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block; ``dtype`` is the pool's storage dtype, and a
    quantized one (int8, float8_e4m3fn) adds its fp16 scale per token per kv head."""
    elem = dtype.itemsize
    if dtype in QMAX:
        per_head = config.head_dim * elem + SCALE_DTYPE.itemsize
    else:
        per_head = config.head_dim * elem
    return 2 * config.num_layers * block_size * config.num_kv_heads * per_head


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    return budget_bytes // bytes_per_block(config, block_size, dtype)


def cuda_kv_budget(device: torch.device, utilization: float) -> int:
    """What is left for the pool after weights and a measured forward, under the utilization cap."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return int(total * utilization) - used


@dataclass(slots=True)
class KVCache:
    layers: list[tuple[KVPool, KVPool]]
    num_blocks: int
    block_size: int

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (int8 / float8_e4m3fn when quantized)."""
        return self.layers[0][0].dtype

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> "KVCache":
        """``dtype``: the model's dtype for a plain pool, or int8 / float8_e4m3fn for a quantized one."""
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget fits {num_blocks} blocks of {block_size} tokens; raise kv_cache_bytes "
                f"(one block needs {bytes_per_block(config, block_size, dtype)} bytes)"
            )
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # torch.empty: no backend lets a slot it does not own reach its output (the Triton
        # kernels mask them, the torch backend zeroes V's padding lanes), and on a CPU untouched
        # pages of a large pool cost nothing until written.
        if dtype in QMAX:
            layers = [(ScaledCache.empty(shape, dtype, device), ScaledCache.empty(shape, dtype, device))
                      for _ in range(config.num_layers)]
        else:
            layers = [
                (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                for _ in range(config.num_layers)
            ]
        return cls(layers, num_blocks, block_size)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)
