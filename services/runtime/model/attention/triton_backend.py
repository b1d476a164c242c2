"""Attention with the Triton kernels of services/runtime/kernels (CUDA; the interpreter on CPU).

write_kv stores the new K/V through ``reshape_and_cache``. attend sends a decode-only step
(one query per sequence) to the split-K paged decode kernel, and every other step (prompts,
chunks, prefix hits, speculative verification, and decode rows mixed among them) to the
varlen prefill kernel, which reads all K/V, the new tokens' included, through the block
tables.
"""

from __future__ import annotations

import torch

from services.runtime.kernels.paged_decode import choose_num_partitions, paged_decode_attention
from services.runtime.kernels.prefill_attention import prefill_attention
from services.runtime.kernels.reshape_and_cache import reshape_and_cache
from services.runtime.model.attention.base import AttentionMetadata

_CPU_PARALLELISM = 1
"""On the CPU (Triton's interpreter runs programs one after another) split-K buys nothing."""


class TritonAttentionBackend:
    name = "triton"

    def __init__(self) -> None:
        self._num_sms: dict[torch.device, int] = {}

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        # k, v: [T, KH, D] -> caches [NB, BS, KH, D] at meta.slot_mapping
        reshape_and_cache(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, meta.slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # q: [T, H, D] -> [T, H, D]
        if meta.is_decode_only:
            num_partitions = choose_num_partitions(
                meta.num_seqs, k_cache.shape[2], meta.max_context_len, self._parallelism(q.device)
            )
            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                max_context_len=meta.max_context_len, num_partitions=num_partitions,
            )
        return prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc, scale,
            max_query_len=meta.max_query_len, max_context_len=meta.max_context_len,
        )

    def _parallelism(self, device: torch.device) -> int:
        """Streaming multiprocessors of ``device``, asked once per device."""
        if device.type != "cuda":
            return _CPU_PARALLELISM
        if device not in self._num_sms:
            self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return self._num_sms[device]
