"""Attention with the Triton kernels of services/runtime/kernels (CUDA; the interpreter on CPU).

write_kv stores the new K/V through ``reshape_and_cache``. attend sends a decode-only step
(one query per sequence) to the split-K paged decode kernel, and every other step (prompts,
chunks, prefix hits, speculative verification, and decode rows mixed among them) to the
varlen prefill kernel, which reads all K/V, the new tokens' included, through the block
tables.
"""

from __future__ import annotations

import torch

from services.runtime.kernels.paged_decode import TILE_TOKENS, choose_num_partitions, paged_decode_attention
from services.runtime.kernels.prefill_attention import prefill_attention, tile_rows
from services.runtime.kernels.kv_quant import ScaledCache
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
        if isinstance(k_cache, ScaledCache):  # the kernel quantizes k and v as they are
            reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
            return
        reshape_and_cache(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, meta.slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        # q: [T, H, D] -> [T, H, D]; softcap: Gemma 2's cap on scores (a model-fixed specialization)
        if meta.is_decode_only:
            num_partitions = choose_num_partitions(
                meta.num_seqs, k_cache.shape[2], meta.max_context_len, self._parallelism(q.device)
            )
            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                max_context_len=meta.max_context_len, num_partitions=num_partitions, window=window,
                softcap=softcap,
            )
        return prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc, scale,
            max_query_len=meta.max_query_len, max_context_len=meta.max_context_len, window=window,
            softcap=softcap,
        )

    def warm_up(self, k_cache, v_cache, num_heads: int, max_context_len: int, dtype: torch.dtype | None = None) -> int:
        """Compile every attention kernel variant a step can select; returns the launches made.

        A step picks among a few constexpr buckets that its lengths decide: the split-K decode
        with one partition or with a partition count padded to a power of two (up to what
        ``choose_num_partitions`` allows for one sequence at ``max_context_len``), and the
        prefill kernel's tile rows (``tile_rows``). Every other length-dependent argument is
        left unspecialized (kernels/_common.py), so these launches cover all of them. Scratch
        inputs: every block table entry is block 0, which is only read; outputs are dropped.
        ``dtype`` is the queries' (the model's); it defaults to a plain pool's own.
        """
        device, dtype = k_cache.device, dtype or k_cache.dtype
        if isinstance(k_cache, ScaledCache) and dtype == k_cache.dtype:
            raise ValueError("warm_up of a quantized pool needs the model's dtype")
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        launches = 0

        def tables(context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
            width = -(-context_len // block_size)
            return (torch.zeros((1, width), dtype=torch.int32, device=device),
                    torch.tensor([context_len], dtype=torch.int32, device=device))

        def queries(num_tokens: int) -> torch.Tensor:
            # q as the model hands it over: [T, H, D] view of the fused q|k|v rows, so the
            # launch's integer strides specialize as a real step's do
            qkv = torch.zeros((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype=dtype, device=device)
            return qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)

        most = choose_num_partitions(1, num_kv_heads, max_context_len, self._parallelism(device))
        buckets = [1] + [1 << i for i in range(1, max(1, most - 1).bit_length() + 1)]
        q = queries(1)
        for partitions in buckets:
            context_len = partitions * TILE_TOKENS  # exactly `partitions` partitions of one tile
            block_tables, context_lens = tables(context_len)
            paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 1.0,
                                   max_context_len=context_len, num_partitions=partitions)
            launches += 1

        queries_per_kv = num_heads // num_kv_heads
        seen: set[int] = set()
        for query_len in range(1, max_context_len + 1):
            rows = tile_rows(query_len, queries_per_kv, head_dim)
            if rows in seen:
                if rows >= tile_rows(max_context_len, queries_per_kv, head_dim):
                    break  # the cap: longer prompts reuse it
                continue
            seen.add(rows)
            block_tables, context_lens = tables(query_len)
            q = queries(query_len)
            starts = torch.tensor([0, query_len], dtype=torch.int32, device=device)
            prefill_attention(q, k_cache, v_cache, block_tables, context_lens, starts, 1.0,
                              max_query_len=query_len, max_context_len=query_len)
            launches += 1
        return launches

    def _parallelism(self, device: torch.device) -> int:
        """Streaming multiprocessors of ``device``, asked once per device."""
        if device.type != "cuda":
            return _CPU_PARALLELISM
        if device not in self._num_sms:
            self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return self._num_sms[device]
