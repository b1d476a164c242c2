"""Attention in plain PyTorch over the paged KV cache: gather through block tables, then attend.

Correct on CPU and GPU and fast enough on a CPU, where it is the default. Decode-only
sequences (one query each) are handled together: their contexts are gathered into one
padded tensor and attended with a length mask, so a decode step costs a few batched ops
per layer instead of one per sequence. Sequences with several new tokens (prompts,
chunks, speculative verification) go one by one through scaled_dot_product_attention.

Soft-capped scores (Gemma 2: ``c * tanh(s / c)`` before the mask and softmax) are something SDPA
cannot do: a layer with a cap takes an explicit matmul, tanh, masked softmax and matmul instead.

A quantized pool (``ScaledCache``) is written by ``kv_quant.write_quantized`` and read by
dequantizing the gathered blocks to the query's dtype before SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.runtime.kernels.kv_quant import ScaledCache, gather_dequantized as gather_pool, write_quantized
from services.runtime.model.attention.base import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        # k, v: [T, KH, D]; caches: [NB, BS, KH, D] viewed as [NB*BS, KH, D] slots
        if isinstance(k_cache, ScaledCache):
            write_quantized(k, v, k_cache, v_cache, meta.slot_mapping)
            return
        kh, d = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, kh, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kh, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        # q: [T, H, D] -> [T, H, D]
        if softcap is not None:
            return self._attend_softcapped(q, k_cache, v_cache, meta, scale, window, softcap)
        if meta.is_decode_only:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.context_lens_cpu, scale,
                                window)
        out = torch.empty_like(q)
        decode_rows = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        starts = meta.query_start_loc.tolist() if len(decode_rows) < meta.num_seqs else None
        if decode_rows:
            rows = torch.tensor(decode_rows, device=q.device)
            token_index = meta.query_start_loc[rows].long()
            out[token_index] = self._decode(
                q[token_index], k_cache, v_cache, meta.block_tables[rows], meta.context_lens[rows],
                [meta.context_lens_cpu[i] for i in decode_rows], scale, window,
            )
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
            if q_len == 1:
                continue
            start = starts[i]
            out[start : start + q_len] = self._extend(
                q[start : start + q_len], k_cache, v_cache, meta.block_tables[i], ctx_len, meta.block_size, scale,
                window,
            )
        return out

    def _attend_softcapped(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None,
                           softcap: float) -> torch.Tensor:
        """Each sequence's queries over its context with capped scores, as transformers' eager
        Gemma 2 attention computes them (scores in the query's dtype, softmax in fp32)."""
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
            start = starts[i]
            qs = q[start : start + q_len]  # [L, H, D]
            k = self._gather(k_cache, meta.block_tables[i], ctx_len, meta.block_size, q.dtype)  # [C, KH, D]
            v = self._gather(v_cache, meta.block_tables[i], ctx_len, meta.block_size, q.dtype)
            if window is not None and ctx_len - q_len + 1 > window:
                # Keys no query sees (their blocks may be back in the pool): zeroed, as NaN there
                # would survive the mask (0 * NaN).
                k[: ctx_len - q_len + 1 - window] = 0
                v[: ctx_len - q_len + 1 - window] = 0
            group = qs.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, C, D]
            v = v.repeat_interleave(group, dim=1).transpose(0, 1)
            scores = torch.matmul(qs.transpose(0, 1), k.transpose(1, 2)) * scale  # [H, L, C]
            scores = torch.tanh(scores / softcap) * softcap
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            k_pos = torch.arange(ctx_len, device=q.device)
            hidden = k_pos[None, :] > q_pos[:, None]  # [L, C]
            if window is not None:
                hidden |= k_pos[None, :] <= q_pos[:, None] - window
            probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1, dtype=torch.float32)
            out[start : start + q_len] = torch.matmul(probs.to(q.dtype), v).transpose(0, 1)
        return out

    @staticmethod
    def _gather(cache, block_table: torch.Tensor, num_tokens: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        num_blocks = -(-num_tokens // block_size)
        # [nb, BS, KH, D] -> [ctx, KH, D]
        return gather_pool(cache, block_table[:num_blocks].long(), dtype).flatten(0, 1)[:num_tokens]

    def _extend(self, q, k_cache, v_cache, block_table, ctx_len: int, block_size: int, scale: float,
                window: int | None = None):
        # q: [L, H, D]; the L new tokens sit at positions [ctx_len - L, ctx_len).
        q_len, num_heads = q.shape[0], q.shape[1]
        k = self._gather(k_cache, block_table, ctx_len, block_size, q.dtype)
        v = self._gather(v_cache, block_table, ctx_len, block_size, q.dtype)
        if window is not None and ctx_len - q_len + 1 > window:
            # Keys before the first query's window are seen by no query: drop them (the positions
            # below count from the first key kept).
            drop = ctx_len - q_len + 1 - window
            k, v, ctx_len = k[drop:], v[drop:], ctx_len - drop
        group = num_heads // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        # [1, H, L|C, D]: with a batch dimension SDPA takes its fused (flash) CPU kernel; 3-D
        # inputs fall back to the math path (bmm, softmax, NaN guards), 2-7x slower for prompts.
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if q_len == ctx_len and (window is None or q_len <= window):
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            # query i sees keys [0, ctx_len - q_len + i], within a window the last `window` of them
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            k_pos = torch.arange(ctx_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [L, C]
            if window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - window
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        return o[0].transpose(0, 1)

    @staticmethod
    def _decode(q, k_cache, v_cache, block_tables, context_lens, context_lens_cpu: list[int], scale: float,
                window: int | None = None):
        # q: [B, H, D]; one query per sequence at position context_len - 1.
        b, h, d = q.shape
        max_ctx = max(context_lens_cpu)
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        num_blocks = -(-max_ctx // block_size)
        span = num_blocks * block_size
        table = block_tables[:, :num_blocks].long().flatten()
        # One gather per pool into [B, S, KH, D], read by SDPA as a strided [B, KH, S, D] view
        # (no second copy); GQA is SDPA's enable_gqa, so K/V are never repeated per query head.
        k = gather_pool(k_cache, table, q.dtype).view(b, span, kv_heads, d)
        v = gather_pool(v_cache, table, q.dtype).view(b, span, kv_heads, d)
        # Padding lanes read slots this sequence does not own. They are masked out of the
        # softmax, but a NaN there would survive it (NaN - inf, 0 * NaN), so zero each row's
        # tail: it touches only the padding, where a masked fill would rewrite all of K and V.
        for row, n in enumerate(context_lens_cpu):
            if n < span:
                k[row, n:].zero_()
                v[row, n:].zero_()
            if window is not None and n > window:
                # Behind the window too: those blocks may have gone back to the pool (kv_groups.py).
                k[row, : n - window].zero_()
                v[row, : n - window].zero_()
        positions = torch.arange(span, device=q.device)
        valid = positions[None, :] < context_lens[:, None].long()  # [B, S]
        if window is not None:  # the query at context_len - 1 sees the last `window` keys
            valid &= positions[None, :] >= context_lens[:, None].long() - window
        out = F.scaled_dot_product_attention(
            q.view(b, h, 1, d), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True,
        )  # [B, H, 1, D]
        return out.view(b, h, d)
