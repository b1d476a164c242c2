"""The torch backend with decode attention done by a C++ kernel that reads the paged cache in place.

Everything but decode rows is the torch backend's: K/V writes, and prompts or chunks through
SDPA (compute-bound, where PyTorch is already efficient). Decode rows (one query per
sequence: whole decode steps and the decode rows of mixed steps) go to
``services.runtime.kernels.cpu.paged_decode``, which skips the torch backend's gather into a
padded copy: the copy moved every K/V byte three times, plus padding to the batch's longest
context, and was most of a CPU decode step's attention time.

The new K/V rows go to the pools through one C++ call per layer (the torch backend's two
index_copy_ with their dtype and view calls cost several times more at a decode step's size).

Quantized pools (kv_quant.ScaledCache) take the same two calls: the C++ write quantizes by
kv_quant's rule, and the decode kernel reads int8 / fp8 values with their scales in place.

The kernels read and write raw pointers through the block tables and slots, so both are checked
against the pool before they run: once per step (every layer shares the step's metadata and
the pools' shape), not once per layer, by C++ passes that report the first bad entry for
Python to raise.
"""

from __future__ import annotations

import torch

from services.runtime.kernels import cpu as cpu_kernels
from services.runtime.kernels.kv_quant import ScaledCache
from services.runtime.model.attention.base import AttentionMetadata
from services.runtime.model.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        cpu_kernels.load()  # raises CpuKernelsUnavailable with the reason
        self._checked_meta: AttentionMetadata | None = None

    def check_step(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> None:
        """The step's block tables and slots against the pool, on the first call with ``meta``."""
        if meta is not self._checked_meta:  # the step's first layer
            num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
            cpu_kernels.check_block_tables(meta.block_tables, meta.context_lens, num_blocks, block_size)
            cpu_kernels.check_slots(meta.slot_mapping, num_blocks * block_size)
            self._checked_meta = meta

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        if isinstance(k_cache, ScaledCache) and self._native_quantized(k, v, k_cache, meta):
            self.check_step(meta, k_cache)
            cpu_kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, slots_checked=True)
            return
        if isinstance(k_cache, ScaledCache) or not self._native(k, k_cache) or not self._native(v, v_cache) or meta.slot_mapping.dtype != torch.int64 \
                or not meta.slot_mapping.is_contiguous():
            return super().write_kv(k, v, k_cache, v_cache, meta)
        self.check_step(meta, k_cache)
        cpu_kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, slots_checked=True)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        self.check_step(meta, k_cache)
        if softcap is not None and meta.is_decode_only and q.device.type == "cpu" and (
                isinstance(k_cache, ScaledCache) or q.dtype == k_cache.dtype == v_cache.dtype):
            # Soft-capped decode rows (Gemma 2) through the C++ kernel, which caps as the reference
            # does; prompts and mixed steps keep the torch backend's capped path.
            return cpu_kernels.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                            inputs_checked=True, window=window, softcap=softcap)
        return super().attend(q, k_cache, v_cache, meta, scale, window, softcap)

    @staticmethod
    def _native(x: torch.Tensor, cache: torch.Tensor) -> bool:
        """Whether the C++ write takes x as it is: [T, KH, D] rows in the cache's dtype, on the CPU."""
        return (x.dtype == cache.dtype and x.device.type == "cpu" and x.dim() == 3 and x.stride(-1) == 1
                and cache.is_contiguous() and x.shape[1:] == cache.shape[2:])

    @staticmethod
    def _native_quantized(k, v, k_cache: ScaledCache, meta: AttentionMetadata) -> bool:
        """Whether the C++ quantized write takes k, v as they are."""
        return (k.device.type == "cpu" and k.dim() == 3 and k.stride(-1) == 1 and v.stride(-1) == 1
                and k.dtype == v.dtype and k.shape[1:] == k_cache.shape[2:] and meta.slot_mapping.dtype == torch.int64
                and meta.slot_mapping.is_contiguous())

    @staticmethod
    def _decode(q, k_cache, v_cache, block_tables, context_lens, context_lens_cpu: list[int], scale: float,
                window: int | None = None):
        if isinstance(k_cache, ScaledCache):
            if q.device.type != "cpu":
                return TorchAttentionBackend._decode(q, k_cache, v_cache, block_tables, context_lens,
                                                     context_lens_cpu, scale, window)
            return cpu_kernels.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                                            inputs_checked=True, window=window)
        if q.device.type != "cpu" or not (q.dtype == k_cache.dtype == v_cache.dtype):
            return TorchAttentionBackend._decode(q, k_cache, v_cache, block_tables, context_lens,
                                                 context_lens_cpu, scale, window)
        # attend() checked these tables (or the step's tables they are rows of) against the pool.
        return cpu_kernels.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, inputs_checked=True,
                                        window=window)
