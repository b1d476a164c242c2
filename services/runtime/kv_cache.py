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

from services.common.kv_groups import KVGroups, kv_groups
from services.runtime.kernels.kv_quant import QMAX, SCALE_DTYPE, ScaledCache
from services.runtime.model.config import ModelConfig

KVPool = torch.Tensor | ScaledCache
"""One layer's K (or V) pool: a plain tensor, or values with scales when quantized."""


def model_kv_groups(config: ModelConfig) -> KVGroups:
    """The model's KV groups (services/common/kv_groups.py): one of every layer unless it mixes
    sliding-window and full-attention layers."""
    return kv_groups(config.layer_windows, config.num_layers)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, groups: KVGroups | None = None) -> int:
    """K and V of one page's layers for one block (every layer without ``groups``); ``dtype``
    is the pool's storage dtype, and a quantized one (int8, float8_e4m3fn) adds its fp16 scale
    per token per kv head."""
    elem = dtype.itemsize
    if dtype in QMAX:
        per_head = config.head_dim * elem + SCALE_DTYPE.itemsize
    else:
        per_head = config.head_dim * elem
    layers = groups.layers_per_page if groups is not None else config.num_layers
    return 2 * layers * block_size * config.num_kv_heads * per_head


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int,
                          groups: KVGroups | None = None) -> int:
    return budget_bytes // bytes_per_block(config, block_size, dtype, groups)


def cuda_kv_budget(device: torch.device, utilization: float) -> int:
    """What is left for the pool after weights and a measured forward, under the utilization cap."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return int(total * utilization) - used


@dataclass(slots=True)
class KVCache:
    layers: list[tuple[KVPool, KVPool]]
    """Per layer, its K and V pools: with KV groups, the layers of one slot share them."""
    num_blocks: int
    block_size: int
    pages: list[tuple[KVPool, KVPool]] | None = None
    """The distinct K and V pools, one pair per slot of a page (None: ``layers``, one each)."""

    @property
    def slots(self) -> list[tuple[KVPool, KVPool]]:
        """The distinct pools: what a block of the pool is made of, in order."""
        return self.pages if self.pages is not None else self.layers

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (int8 / float8_e4m3fn when quantized)."""
        return self.layers[0][0].dtype

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
        groups: KVGroups | None = None,
    ) -> "KVCache":
        """``dtype``: the model's dtype for a plain pool, or int8 / float8_e4m3fn for a quantized one.
        ``groups``: KV groups whose layers share pages (one slot per layer of a group), each
        group indexing them with block ids of its own; None gives every layer its own pools."""
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget fits {num_blocks} blocks of {block_size} tokens; raise kv_cache_bytes "
                f"(one block needs {bytes_per_block(config, block_size, dtype, groups)} bytes)"
            )
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        num_slots = groups.layers_per_page if groups is not None else config.num_layers
        # torch.empty: no backend lets a slot it does not own reach its output (the Triton
        # kernels mask them, the torch backend zeroes V's padding lanes), and on a CPU untouched
        # pages of a large pool cost nothing until written.
        if dtype in QMAX:
            slots = [(ScaledCache.empty(shape, dtype, device), ScaledCache.empty(shape, dtype, device))
                     for _ in range(num_slots)]
        else:
            slots = [
                (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                for _ in range(num_slots)
            ]
        if groups is None or groups.num_groups == 1:
            return cls(slots, num_blocks, block_size)
        layers = [slots[groups.place(layer)[1]] for layer in range(config.num_layers)]
        return cls(layers, num_blocks, block_size, pages=slots)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.slots)
