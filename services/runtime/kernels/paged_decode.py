"""Paged decode attention: one new query token per sequence, K/V read through block tables.

Flash-decoding layout. Stage 1 runs one program per (sequence, kv head, context partition):
the program holds every query head of its KV group (GQA), so each K/V tile is loaded once
per group, and keeps an fp32 online softmax over its partition. Stage 2 combines the
partitions of each (sequence, head) with their log-sum-exp. With one partition stage 1
writes the final output and stage 2 is skipped. The loop over a partition's K/V tiles is the
one the prefill kernel runs (paged_kv_tiles.py).

Shapes (B = sequences, H = query heads, KH = kv heads, D = head dim, P = partitions):
  q            [B, H, D]                      one token per sequence
  k/v cache    [num_blocks, block_size, KH, D]
  block_tables [B, max_blocks_per_seq] int32
  context_lens [B] int32                      >= 1, includes the query token itself
  out          [B, H, D]

A quantized pool (kv_quant.ScaledCache: int8 / float8_e4m3fn values, fp16 scales
[num_blocks, block_size, KH]) is read as it is stored: the values widen exactly to q's dtype,
each token's K scale multiplies its column of q.k scores after the dot, and its V scale
multiplies its softmax weight before p.V. So K/V are never dequantized in memory, and the
extra work per tile is N scale loads and two [M, N] multiplies.

Imports only torch, triton and the standard library: the module is timed on GPU machines
that have nothing else, and imports (without launching) on machines with no GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from services.runtime.kernels._common import (
    LOG2E, NOT_SPECIALIZED, check_out, check_paged_attention_inputs, dot_flags, kv_quant_args, round_up,
)
from services.runtime.kernels.kv_quant import gather_dequantized
from services.runtime.kernels.paged_kv_tiles import attend_kv_tiles

TILE_TOKENS = 64
"""Context tokens per inner-loop tile (independent of the cache block size)."""
_MIN_PARTITION_TOKENS = 256
"""Below this many tokens per partition the second pass costs more than it saves."""


@triton.jit(**NOT_SPECIALIZED)
def _paged_decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    qk_scale_log2,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    stride_pob, stride_poh, stride_pop,
    stride_pmb, stride_pmh,
    partition_tokens,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr, HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    KV_QUANT: tl.constexpr, NUM_KV_HEADS: tl.constexpr, window, WINDOWED: tl.constexpr,
    softcap, SOFTCAPPED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    part_start = part * partition_tokens
    if part_start < context_len:
        part_end = tl.minimum(part_start + partition_tokens, context_len)
        key_start = part_start
        if WINDOWED:  # the query at context_len - 1 sees the last `window` keys
            key_start = tl.minimum(tl.maximum(part_start, context_len - window), part_end)

        q, heads, head_valid, dims, dim_valid = _load_group_queries(
            q_ptr, seq, kv_head, stride_qb, stride_qh, HEAD_DIM, HEAD_DIM_PAD, QUERIES_PER_KV, HEADS_PAD)

        m_i = tl.full([HEADS_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([HEADS_PAD], dtype=tl.float32)
        acc = tl.zeros([HEADS_PAD, HEAD_DIM_PAD], dtype=tl.float32)

        block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        # Every tile holds a valid token, and the query (the sequence's last position) sees every
        # key: masked at part_end, not causal, so the query position argument goes unread.
        acc, l_i, m_i = attend_kv_tiles(
            acc, l_i, m_i, q, context_len - 1, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_row,
            kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            key_start, part_end, qk_scale_log2, dims, dim_valid,
            BLOCK_SIZE, TILE_N, True, False, DOT_PRECISION, DOT_UPCAST, KV_QUANT, NUM_KV_HEADS,
            softcap=softcap, SOFTCAPPED=SOFTCAPPED)

        _store_partition(acc, l_i, m_i, seq, part, heads, head_valid, dims, dim_valid,
                         out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, stride_ob, stride_oh,
                         stride_pob, stride_poh, stride_pop, stride_pmb, stride_pmh, SINGLE_PARTITION)


@triton.jit
def _load_group_queries(q_ptr, seq, kv_head, stride_qb, stride_qh, HEAD_DIM: tl.constexpr,
                        HEAD_DIM_PAD: tl.constexpr, QUERIES_PER_KV: tl.constexpr, HEADS_PAD: tl.constexpr):
    """The query heads of one KV group as the rows of q [M, D_PAD]; the heads, dims and their masks."""
    head_in_group = tl.arange(0, HEADS_PAD)  # [M]
    head_valid = head_in_group < QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + head_in_group
    dims = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]
    dim_valid = dims < HEAD_DIM
    # padded heads and dims load as 0 and are never stored
    q_offsets = seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=head_valid[:, None] & dim_valid[None, :], other=0.0)
    return q, heads, head_valid, dims, dim_valid


@triton.jit
def _store_partition(acc, l_i, m_i, seq, part, heads, head_valid, dims, dim_valid,
                     out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, stride_ob, stride_oh,
                     stride_pob, stride_poh, stride_pop, stride_pmb, stride_pmh, SINGLE_PARTITION: tl.constexpr):
    """One partition's result: the output itself when it is the only one, else its normalized
    output, running max and sum for the reduction."""
    store_mask = head_valid[:, None] & dim_valid[None, :]
    if SINGLE_PARTITION:
        o_offsets = seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offsets, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        po_offsets = (seq.to(tl.int64) * stride_pob + heads[:, None] * stride_poh + part * stride_pop
                      + dims[None, :])
        # a partition wholly before the window has l = 0 and weight 0 in the reduction: store 0, not NaN
        tl.store(part_out_ptr + po_offsets, acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None], mask=store_mask)
        pm_offsets = seq.to(tl.int64) * stride_pmb + heads * stride_pmh + part
        tl.store(part_max_ptr + pm_offsets, m_i, mask=head_valid)
        tl.store(part_sum_ptr + pm_offsets, l_i, mask=head_valid)


@triton.jit(**NOT_SPECIALIZED)
def _paged_decode_reduce_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, context_lens_ptr,
    stride_ob, stride_oh,
    stride_pob, stride_poh, stride_pop,
    stride_pmb, stride_pmh,
    partition_tokens,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PARTITIONS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    # partitions past this sequence's context were never written (their programs exited)
    num_parts = tl.cdiv(context_len, partition_tokens)

    parts = tl.arange(0, PARTITIONS_PAD)  # [P_PAD]
    part_valid = parts < num_parts
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    pm_offsets = seq.to(tl.int64) * stride_pmb + head * stride_pmh + parts
    part_max = tl.load(part_max_ptr + pm_offsets, mask=part_valid, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + pm_offsets, mask=part_valid, other=0.0)
    po_offsets = seq.to(tl.int64) * stride_pob + head * stride_poh + parts[:, None] * stride_pop + dims[None, :]
    part_out = tl.load(part_out_ptr + po_offsets, mask=part_valid[:, None] & dim_valid[None, :], other=0.0)

    # out = sum_p w_p * o_p / sum_p w_p with w_p = l_p * 2^(m_p - max m); o_p is normalized per partition
    global_max = tl.max(part_max, axis=0)
    weights = tl.where(part_valid, part_sum * tl.exp2(part_max - global_max), 0.0)  # [P_PAD]
    out = tl.sum(part_out * weights[:, None], axis=0) / tl.sum(weights, axis=0)  # [D_PAD]
    o_offsets = seq.to(tl.int64) * stride_ob + head * stride_oh + dims
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=dim_valid)


def choose_num_partitions(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int = 132) -> int:
    """Split-K factor: enough (sequence, kv head, partition) programs to fill ~4 waves of SMs,
    but never partitions shorter than _MIN_PARTITION_TOKENS (the reduction would dominate)."""
    max_useful = max(1, math.ceil(max_context_len / _MIN_PARTITION_TOKENS))
    wanted = max(1, math.ceil(4 * num_sms / max(1, num_seqs * num_kv_heads)))
    return min(max_useful, wanted)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    num_partitions: int = 1,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context. Returns out [B, H, D].
    ``window``: the query sees only the last ``window`` keys (a sliding-window layer).
    ``softcap``: scores ``softcap * tanh(s / softcap)`` (Gemma 2); None: uncapped.

    ``max_context_len`` (a host int, >= every context_lens entry) sizes the partitions without
    a device sync. ``num_partitions`` > 1 enables split-K; see ``choose_num_partitions``.
    """
    num_seqs, num_heads, head_dim = q.shape
    out = _checked_out(q, k_cache, v_cache, block_tables, context_lens, max_context_len, num_partitions, out)
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return out
    k_cache, v_cache, k_scale, v_scale, quantized = kv_quant_args(k_cache, v_cache)

    queries_per_kv = num_heads // num_kv_heads
    partition_tokens = round_up(math.ceil(max_context_len / num_partitions), TILE_TOKENS)
    num_partitions = math.ceil(max_context_len / partition_tokens)
    single = num_partitions == 1
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    part_out, part_max, part_sum = _partials(out, num_partitions)
    _paged_decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
        out, part_out, part_max, part_sum,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_max.stride(0), part_max.stride(1),
        partition_tokens,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        QUERIES_PER_KV=queries_per_kv, HEADS_PAD=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_SIZE=block_size, TILE_N=TILE_TOKENS,
        SINGLE_PARTITION=single, **dot_flags(q.dtype, _paged_decode_partition_kernel),
        KV_QUANT=quantized, NUM_KV_HEADS=num_kv_heads,
        window=int(window or 0), WINDOWED=window is not None and window < max_context_len,
        softcap=float(softcap or 0.0), SOFTCAPPED=softcap is not None,
        num_warps=4,
    )
    if not single:
        _reduce_partitions(out, part_out, part_max, part_sum, context_lens, partition_tokens, head_dim_pad)
    return out


def _checked_out(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, max_context_len: int, num_partitions: int,
                 out: torch.Tensor | None) -> torch.Tensor:
    """The output buffer (``out`` checked, or a new one) once the inputs are checked."""
    check_paged_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, q.shape[0], max_context_len)
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if out is None:
        return torch.empty_like(q)
    check_out(out, q)
    return out


def _partials(out: torch.Tensor, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1's per-partition output [B, H, P, D], max and sum [B, H, P] (fp32); with one
    partition stage 1 writes ``out`` directly and these are never touched."""
    if num_partitions == 1:
        part_max = out.new_empty((1, 1, 1), dtype=torch.float32)
        return out.new_empty((1, 1, 1, 1), dtype=torch.float32), part_max, part_max
    num_seqs, num_heads, head_dim = out.shape
    part_out = torch.empty((num_seqs, num_heads, num_partitions, head_dim), dtype=torch.float32, device=out.device)
    part_max = torch.empty((num_seqs, num_heads, num_partitions), dtype=torch.float32, device=out.device)
    return part_out, part_max, torch.empty_like(part_max)


def _reduce_partitions(out: torch.Tensor, part_out: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor,
                       context_lens: torch.Tensor, partition_tokens: int, head_dim_pad: int) -> None:
    """Stage 2: each (sequence, head)'s partitions combined into ``out``."""
    num_seqs, num_heads, num_partitions, head_dim = part_out.shape
    _paged_decode_reduce_kernel[(num_seqs, num_heads)](
        out, part_out, part_max, part_sum, context_lens,
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_max.stride(0), part_max.stride(1),
        partition_tokens,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        PARTITIONS_PAD=triton.next_power_of_2(num_partitions),
        num_warps=4,
    )


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Loop-per-sequence reference in the inputs' dtype (softmax in fp32). Returns [B, H, D].
    ``window``: the query sees only the last ``window`` keys (a sliding-window layer);
    ``softcap``: scores ``softcap * tanh(s / softcap)`` before the mask."""
    num_seqs, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for seq in range(num_seqs):
        context_len = int(context_lens[seq])
        num_blocks = math.ceil(context_len / block_size)
        blocks = block_tables[seq, :num_blocks].long()
        # [C, KH, D]; a quantized pool (kv_quant.ScaledCache) dequantized to q's dtype
        keys = gather_dequantized(k_cache, blocks, q.dtype).flatten(0, 1)[:context_len]
        values = gather_dequantized(v_cache, blocks, q.dtype).flatten(0, 1)[:context_len]
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)  # [H, C, D]
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        scores = (q[seq].unsqueeze(1) @ keys.transpose(1, 2)).float() * scale  # [H, 1, C]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if window is not None and context_len > window:
            scores[..., : context_len - window] = float("-inf")
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[seq] = (probs @ values).squeeze(1)
    return out
