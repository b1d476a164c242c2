"""Varlen prefill/extend attention over a paged KV cache (FlashAttention-2 style tiling).

Each sequence brings ``query_len`` new tokens whose K/V the backend has already written into
the pool; its ``context_len`` counts them too. New query i sits at position
``context_len - query_len + i`` and sees keys [0, that position]. The same kernel therefore
serves whole prompts (no prefix), prefill chunks and prefix-cache hits (a cached prefix),
decode rows in a mixed batch (query_len 1) and speculative verification (k+1 tokens).

One program per (sequence, query tile, kv head). The tile's rows are (query token, head in
the KV group) pairs, so every query head of one group shares each K/V tile load (GQA). Key
tiles wholly left of the tile's first query need no causal mask and take the unmasked loop
(paged_kv_tiles.py, the loop the decode kernel runs too).

Shapes (T = new tokens, B = sequences, H = query heads, KH = kv heads, D = head dim):
  q               [T, H, D]
  k/v cache       [num_blocks, block_size, KH, D]
  block_tables    [B, max_blocks_per_seq] int32
  context_lens    [B] int32
  query_start_loc [B+1] int32   (cu_seqlens of the new tokens)
  out             [T, H, D]

A quantized pool (kv_quant.ScaledCache) is read as paged_decode.py reads it: values widened
exactly to q's dtype, K scales applied to the scores after the dot, V scales to the weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.runtime.kernels._common import (
    LOG2E, NOT_SPECIALIZED, check_out, check_paged_attention_inputs, dot_flags, kv_quant_args,
)
from services.runtime.kernels.kv_quant import gather_dequantized
from services.runtime.kernels.paged_kv_tiles import attend_kv_tiles


@triton.jit(**NOT_SPECIALIZED)
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr,
    query_start_loc_ptr, out_ptr,
    qk_scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_QUANT: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    window, WINDOWED: tl.constexpr, softcap, SOFTCAPPED: tl.constexpr,
):
    tl.static_assert(BLOCK_Q * QUERIES_PER_KV <= BLOCK_M)
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    tile_first_query = q_tile * BLOCK_Q
    if tile_first_query < query_len:  # the grid covers the longest sequence; shorter ones exit
        context_len = tl.load(context_lens_ptr + seq)
        prefix_len = context_len - query_len  # tokens cached before this step's new ones

        rows = tl.arange(0, BLOCK_M)  # [M]: row = (query token, head within the kv group)
        query_idx = tile_first_query + rows // QUERIES_PER_KV
        heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
        row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (query_idx < query_len)
        query_pos = prefix_len + query_idx  # [M]
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_valid = dims < HEAD_DIM
        io_mask = row_valid[:, None] & dim_valid[None, :]

        tokens = (query_start + query_idx).to(tl.int64)
        q_offsets = tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)  # [M, D_PAD]

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

        # the tile's last real query sees up to its own position
        key_end = tl.minimum(prefix_len + tile_first_query + BLOCK_Q, context_len)
        acc, l_i, m_i = _attend_visible_keys(
            acc, l_i, m_i, q, query_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            prefix_len + tile_first_query, key_end, qk_scale_log2, dims, dim_valid, window, softcap,
            BLOCK_SIZE, TILE_N, DOT_PRECISION, DOT_UPCAST, KV_QUANT, NUM_KV_HEADS, WINDOWED, SOFTCAPPED)

        o_offsets = tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offsets, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _attend_visible_keys(
    acc, l_i, m_i, q, query_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, kv_head,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    first_query_pos, key_end, qk_scale_log2, dims, dim_valid, window, softcap,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    KV_QUANT: tl.constexpr, NUM_KV_HEADS: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAPPED: tl.constexpr,
):
    """A query tile's rows attended over the keys up to ``key_end`` that each may see; the
    tile's first query sits at ``first_query_pos``."""
    if WINDOWED:
        # A sliding window: keys from the tile's first query's window on, every tile masked
        # (the window's lower edge differs per row, as the causal edge does).
        key_start = tl.maximum(first_query_pos - window + 1, 0)
        acc, l_i, m_i = attend_kv_tiles(
            acc, l_i, m_i, q, query_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row,
            kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            key_start, key_end, qk_scale_log2, dims, dim_valid,
            BLOCK_SIZE, TILE_N, True, True, DOT_PRECISION, DOT_UPCAST, KV_QUANT, NUM_KV_HEADS, window, True,
            softcap=softcap, SOFTCAPPED=SOFTCAPPED)
    else:
        # keys <= the tile's first query position are visible to every row of the tile
        unmasked_end = (first_query_pos + 1) // TILE_N * TILE_N
        acc, l_i, m_i = attend_kv_tiles(
            acc, l_i, m_i, q, query_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            0, unmasked_end, qk_scale_log2, dims, dim_valid,
            BLOCK_SIZE, TILE_N, False, False, DOT_PRECISION, DOT_UPCAST, KV_QUANT, NUM_KV_HEADS,
            softcap=softcap, SOFTCAPPED=SOFTCAPPED)
        acc, l_i, m_i = attend_kv_tiles(
            acc, l_i, m_i, q, query_pos, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            unmasked_end, key_end, qk_scale_log2, dims, dim_valid,
            BLOCK_SIZE, TILE_N, True, True, DOT_PRECISION, DOT_UPCAST, KV_QUANT, NUM_KV_HEADS,
            softcap=softcap, SOFTCAPPED=SOFTCAPPED)
    return acc, l_i, m_i


def tile_rows(max_query_len: int, queries_per_kv: int, head_dim: int) -> int:
    """BLOCK_M, the rows of a query tile (query tokens x heads of the group): a power of two.

    The one launch constexpr that follows the step (through ``max_query_len``); it takes few
    values, from 16 up to the cap, which the executor's warm-up compiles ahead.
    """
    # 128 rows keep the MMA busy, 64 above D=128 keep the fp32 accumulator in registers
    max_rows = 128 if max(16, triton.next_power_of_2(head_dim)) <= 128 else 64
    return min(max(16, triton.next_power_of_2(max_query_len * queries_per_kv)),
               max(max_rows, triton.next_power_of_2(queries_per_kv)))


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context. Returns [T, H, D].
    ``window``: each query sees only the last ``window`` keys up to itself (a sliding-window layer).
    ``softcap``: scores ``softcap * tanh(s / softcap)`` (Gemma 2); None: uncapped.

    ``max_query_len`` and ``max_context_len`` are host ints (>= the per-sequence values) that
    size the grid without a device sync. Requires query_len <= context_len per sequence.
    """
    _, num_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0] if block_tables.dim() == 2 else -1
    check_paged_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, num_seqs, max_context_len)
    _check_new_tokens(q, query_start_loc, num_seqs, max_query_len, max_context_len)
    if out is None:
        out = torch.empty_like(q)
    else:
        check_out(out, q)
    if num_seqs == 0:
        return out

    _, block_size, num_kv_heads, _ = k_cache.shape
    k_cache, v_cache, k_scale, v_scale, quantized = kv_quant_args(k_cache, v_cache)
    queries_per_kv = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    if queries_per_kv > 128:
        raise ValueError(f"at most 128 query heads per kv head, got {queries_per_kv}")
    block_m = tile_rows(max_query_len, queries_per_kv, head_dim)
    block_q = block_m // queries_per_kv
    tile_n = 64 if head_dim_pad <= 128 else 32
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, query_start_loc, out,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_SIZE=block_size, TILE_N=tile_n,
        **dot_flags(q.dtype, _prefill_attention_kernel), KV_QUANT=quantized, NUM_KV_HEADS=num_kv_heads,
        window=int(window or 0), WINDOWED=window is not None and window < max_context_len,
        softcap=float(softcap or 0.0), SOFTCAPPED=softcap is not None,
        num_warps=8 if block_m >= 128 else 4,
    )
    return out


def _check_new_tokens(q: torch.Tensor, query_start_loc: torch.Tensor, num_seqs: int, max_query_len: int,
                      max_context_len: int) -> None:
    """ValueError naming query_start_loc or max_query_len when they do not fit ``q``'s tokens."""
    num_tokens = q.shape[0]
    if (query_start_loc.dtype != torch.int32 or tuple(query_start_loc.shape) != (num_seqs + 1,)
            or not query_start_loc.is_contiguous() or query_start_loc.device != q.device):
        raise ValueError(f"query_start_loc must be contiguous int32 [{num_seqs + 1}] on {q.device}, got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)} on {query_start_loc.device}")
    if not 1 <= max_query_len <= min(num_tokens, max_context_len):
        raise ValueError(f"max_query_len must be in [1, min(tokens={num_tokens}, max_context_len="
                         f"{max_context_len})], got {max_query_len}")


def prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Loop-per-sequence reference in the inputs' dtype (softmax in fp32). Returns [T, H, D].
    ``window``: each query sees only the last ``window`` keys up to itself (a sliding-window layer);
    ``softcap``: scores ``softcap * tanh(s / softcap)`` before the mask."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for seq in range(block_tables.shape[0]):
        start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        query_len, context_len = end - start, int(context_lens[seq])
        blocks = block_tables[seq, : -(-context_len // block_size)].long()
        # [C, KH, D]; a quantized pool (kv_quant.ScaledCache) dequantized to q's dtype
        keys = gather_dequantized(k_cache, blocks, q.dtype).flatten(0, 1)[:context_len]
        values = gather_dequantized(v_cache, blocks, q.dtype).flatten(0, 1)[:context_len]
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)  # [H, C, D]
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        queries = q[start:end].transpose(0, 1)  # [H, L, D]
        scores = (queries @ keys.transpose(1, 2)).float() * scale  # [H, L, C]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        # query i sits at position context_len - query_len + i and sees keys up to it
        query_pos = torch.arange(context_len - query_len, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)[None, :]
        hidden = key_pos > query_pos[:, None]  # [L, C]
        if window is not None:
            hidden |= key_pos <= query_pos[:, None] - window
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).to(q.dtype)
        out[start:end] = (probs @ values).transpose(0, 1)
    return out
