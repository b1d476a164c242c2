"""The torch backend with decode attention done by a C++ kernel that reads the paged cache in place.

Everything but decode rows is the torch backend's: K/V writes, and prompts or chunks through
SDPA (compute-bound, where PyTorch is already efficient). Decode rows (one query per
sequence: whole decode steps and the decode rows of mixed steps) go to
``services.runtime.kernels.cpu.paged_decode``, which skips the torch backend's gather into a
padded copy: the copy moved every K/V byte three times, plus padding to the batch's longest
context, and was most of a CPU decode step's attention time.

The kernel reads raw pointers through the block tables, so the tables are checked against the
pool in Python before it runs: once per step (every layer shares the step's metadata and the
pools' shape), not once per layer.
"""

from __future__ import annotations

import torch

from services.runtime.kernels import cpu as cpu_kernels
from services.runtime.model.attention.base import AttentionMetadata
from services.runtime.model.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        cpu_kernels.load()  # raises CpuKernelsUnavailable with the reason
        self._checked_meta: AttentionMetadata | None = None

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta is not self._checked_meta:  # the step's first layer
            cpu_kernels.check_block_tables(meta.block_tables, meta.context_lens, k_cache.shape[0], k_cache.shape[1])
            self._checked_meta = meta
        return super().attend(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def _decode(q, k_cache, v_cache, block_tables, context_lens, context_lens_cpu: list[int], scale: float):
        if q.device.type != "cpu" or not (q.dtype == k_cache.dtype == v_cache.dtype):
            return TorchAttentionBackend._decode(q, k_cache, v_cache, block_tables, context_lens,
                                                 context_lens_cpu, scale)
        # attend() checked these tables (or the step's tables they are rows of) against the pool.
        return cpu_kernels.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, inputs_checked=True)
