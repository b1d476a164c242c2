"""The inner loop both paged attention kernels share (paged_decode.py, prefill_attention.py):
K/V tiles read through a sequence's block table, and an online softmax over them.

Rows of ``q`` are whatever the caller packs (decode: the query heads of one KV group;
prefill: (query token, head in the group) pairs); each K/V tile is loaded once for all of them.
A quantized pool (kv_quant.ScaledCache) is read as stored: values widened exactly to q's
dtype, each token's K scale applied to its column of scores after the dot, its V scale to its
softmax weight before p.V.

Imports only triton and the standard library (see the package docstring).
"""

from __future__ import annotations

import triton
import triton.language as tl

from services.runtime.kernels._common import dot

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # 1 / ln 2
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def attend_kv_tiles(
    acc, l_i, m_i, q, query_pos,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, kv_head,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    key_start, key_end, qk_scale_log2, dims, dim_valid,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_QUANT: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    window=0, WINDOWED: tl.constexpr = False, softcap=0.0, SOFTCAPPED: tl.constexpr = False,
):
    """Online softmax of the rows of ``q`` [M, D_PAD] over keys [key_start, key_end), folded into
    (acc [M, D_PAD], l_i [M], m_i [M]). MASKED: the last tile's keys past key_end are excluded
    (without, every tile must be whole). CAUSAL (with MASKED): so are keys past a row's own
    position, ``query_pos`` [M]; without, ``query_pos`` is not read. WINDOWED (with CAUSAL): also
    keys at or before ``query_pos - window`` (a sliding-window layer). SOFTCAPPED: scores
    become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2).

    Without WINDOWED the caller guarantees that each row sees a key in the first tile (decode:
    every tile holds a valid key; prefill: key 0 is visible to every row), so m_i is finite from
    then on and a row with no visible key in a later tile gets p = 0, not NaN. With it a row's
    first tiles may hide every key: its running max stays -inf, and the exponentials are taken
    against 0 instead, so such a tile adds p = 0 and scales nothing."""
    for tile_start in range(key_start, key_end, TILE_N):
        keys = tile_start + tl.arange(0, TILE_N)  # [N]
        k, v, key_valid, k_scale, v_scale = _load_kv_tile(
            keys, key_end, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, dims, dim_valid, q.dtype,
            BLOCK_SIZE, MASKED, KV_QUANT, NUM_KV_HEADS)
        scores = dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST)  # [M, N]
        if KV_QUANT:
            scores = scores * k_scale[None, :]
        scores = _log2_scores(scores, keys, key_valid, query_pos, qk_scale_log2, window, softcap,
                              MASKED, CAUSAL, WINDOWED, SOFTCAPPED)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        if WINDOWED:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: p = 0, alpha = 0
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_QUANT:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _load_kv_tile(
    keys, key_end, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row, kv_head,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, dims, dim_valid, q_dtype: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, KV_QUANT: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
):
    """The tile's K and V [N, D_PAD] read through the block table (in q's dtype), which of its
    keys lie before key_end, and with KV_QUANT each key's K and V scale [N] (else 1.0, unread)."""
    if MASKED:
        key_valid = keys < key_end
        kv_mask = key_valid[:, None] & dim_valid[None, :]
    else:
        key_valid = keys >= 0
        kv_mask = dim_valid[None, :]
    # int64 before multiplying by the block stride: a large pool overflows int32
    block_ids = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    in_block = (keys % BLOCK_SIZE).to(tl.int64)
    k_offsets = block_ids * stride_kb + in_block * stride_kt + kv_head * stride_kh  # [N]
    k = tl.load(k_cache_ptr + k_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, D_PAD]
    v_offsets = block_ids * stride_vb + in_block * stride_vt + kv_head * stride_vh
    v = tl.load(v_cache_ptr + v_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    k_scale = 1.0
    v_scale = 1.0
    if KV_QUANT:  # scales [NB, BS, KH] contiguous; values widen exactly (via fp32: see kv_quant)
        scale_offsets = (block_ids * BLOCK_SIZE + in_block) * NUM_KV_HEADS + kv_head  # [N]
        k_scale = tl.load(k_scale_ptr + scale_offsets, mask=key_valid, other=0.0).to(tl.float32)
        v_scale = tl.load(v_scale_ptr + scale_offsets, mask=key_valid, other=0.0).to(tl.float32)
        k = k.to(tl.float32).to(q_dtype)
        v = v.to(tl.float32).to(q_dtype)
    return k, v, key_valid, k_scale, v_scale


@triton.jit
def _log2_scores(
    scores, keys, key_valid, query_pos, qk_scale_log2, window, softcap,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAPPED: tl.constexpr,
):
    """q.k [M, N] scaled into exp2's base (soft-capped first with SOFTCAPPED), -inf where a row
    may not see the key (see attend_kv_tiles)."""
    if SOFTCAPPED:
        # tanh(x) = 2 sigmoid(2x) - 1, on the scaled score, then into exp2's base
        capped = scores * (qk_scale_log2 * LN2) / softcap
        scores = softcap * (2.0 * tl.sigmoid(2.0 * capped) - 1.0) * LOG2E
    else:
        scores = scores * qk_scale_log2
    if MASKED:
        if CAUSAL:
            visible = key_valid[None, :] & (keys[None, :] <= query_pos[:, None])
            if WINDOWED:
                visible = visible & (keys[None, :] > query_pos[:, None] - window)
        else:
            visible = key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    return scores
