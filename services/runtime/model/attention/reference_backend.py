"""Attention built directly from the kernels' loop-per-sequence references: slow, obviously
right, the ground truth the torch and triton backends are tested against."""

from __future__ import annotations

import torch

from services.runtime.kernels.kv_quant import ScaledCache
from services.runtime.kernels.paged_decode import paged_decode_reference
from services.runtime.kernels.prefill_attention import prefill_attention_reference
from services.runtime.kernels.reshape_and_cache import reshape_and_cache_reference
from services.runtime.model.attention.base import AttentionMetadata


class ReferenceAttentionBackend:
    name = "reference"

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        if isinstance(k_cache, ScaledCache):  # quantized: the reference quantizes k and v as they are
            reshape_and_cache_reference(k, v, k_cache, v_cache, meta.slot_mapping)
            return
        reshape_and_cache_reference(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, meta.slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        # q: [T, H, D] -> [T, H, D]
        if meta.is_decode_only:
            return paged_decode_reference(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, window)
        return prefill_attention_reference(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc, scale, window
        )
