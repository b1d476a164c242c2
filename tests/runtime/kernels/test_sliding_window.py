"""Sliding-window attention (a query sees its own key and the ``window - 1`` before it) in every
backend: the Triton decode and prefill kernels, the C++ CPU decode kernel and the torch backend,
against the loop-per-sequence references; and the references against a dense mask built here.
Windows of 1, shorter than a block, straddling blocks and tiles, and longer than the context."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.kernel_cases import assert_matches_reference, build_paged_batch, poisoned_like

from services.runtime.kernels import cpu as cpu_kernels
from services.runtime.kernels.kv_quant import ScaledCache, quantize
from services.runtime.kernels.paged_decode import paged_decode_attention, paged_decode_reference
from services.runtime.kernels.prefill_attention import prefill_attention, prefill_attention_reference
from services.runtime.model.attention.base import AttentionMetadata
from services.runtime.model.attention.reference_backend import ReferenceAttentionBackend
from services.runtime.model.attention.torch_backend import TorchAttentionBackend

# (context_len, query_len): decode rows, a whole prompt, chunks over cached prefixes, speculative rows
MIXED = [(1, 1), (70, 70), (97, 5), (300, 1), (257, 40), (130, 130)]
WINDOWS = [1, 7, 64, 100, 1000]


def dense_window_attention(q, keys, values, query_pos, window, scale):
    """q [L, H, D], keys/values [C, H, D] (heads expanded), query_pos [L] -> [L, H, D]."""
    k_pos = torch.arange(keys.shape[0])
    visible = (k_pos[None, :] <= query_pos[:, None]) & (k_pos[None, :] > query_pos[:, None] - window)
    scores = torch.einsum("lhd,chd->hlc", q.double(), keys.double()) * scale
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hlc,chd->lhd", probs, values.double()).float()


@pytest.mark.parametrize("window", WINDOWS)
def test_references_equal_a_dense_window_mask(window):
    torch.manual_seed(0)
    context_lens, query_lens = zip(*MIXED)
    batch = build_paged_batch(list(context_lens), list(query_lens), 2, 16, 16, torch.float32, torch.device("cpu"))
    q = torch.randn(sum(query_lens), 4, 16)
    out = prefill_attention_reference(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
                                      batch.query_start_loc, 0.25, window)
    start = 0
    for seq, (ctx, n) in enumerate(MIXED):
        slots = batch.slots[sum(context_lens[:seq]) : sum(context_lens[: seq + 1])]
        keys = batch.k_cache.view(-1, 2, 16)[slots].repeat_interleave(2, dim=1)
        values = batch.v_cache.view(-1, 2, 16)[slots].repeat_interleave(2, dim=1)
        expected = dense_window_attention(q[start : start + n], keys, values, torch.arange(ctx - n, ctx), window, 0.25)
        torch.testing.assert_close(out[start : start + n], expected, atol=1e-5, rtol=1e-5)
        if n == 1:
            decode = paged_decode_reference(q[start : start + 1], batch.k_cache, batch.v_cache,
                                            batch.block_tables[seq : seq + 1], batch.context_lens[seq : seq + 1],
                                            0.25, window)
            torch.testing.assert_close(decode, expected, atol=1e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("head_dim,gqa,block_size,dtype", [(64, 1, 16, torch.float32), (80, 3, 32, torch.float16),
                                                           (16, 8, 16, torch.bfloat16)])
def test_triton_prefill_honours_the_window(window, head_dim, gqa, block_size, dtype, device):
    context_lens, query_lens = zip(*MIXED)
    batch = build_paged_batch(list(context_lens), list(query_lens), 2, head_dim, block_size, dtype, device)
    q = torch.randn(sum(query_lens), 2 * gqa, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    out = poisoned_like(q)
    prefill_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, batch.query_start_loc,
                      scale, max_query_len=batch.max_query_len, max_context_len=batch.max_context_len, out=out,
                      window=window)
    assert_matches_reference(out, lambda q, k, v: prefill_attention_reference(
        q, k, v, batch.block_tables, batch.context_lens, batch.query_start_loc, scale, window), q, batch.k_cache,
        batch.v_cache)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_partitions", [1, 3])
def test_triton_decode_honours_the_window(window, num_partitions, device):
    context_lens = [1, 17, 300, 1025, 64]
    batch = build_paged_batch(context_lens, [1] * len(context_lens), 2, 64, 16, torch.float32, device)
    q = torch.randn(len(context_lens), 4, 64, device=device)
    out = paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
                                 max_context_len=batch.max_context_len, num_partitions=num_partitions, window=window)
    assert_matches_reference(out, lambda q, k, v: paged_decode_reference(
        q, k, v, batch.block_tables, batch.context_lens, 0.125, window), q, batch.k_cache, batch.v_cache)


# head dims 8/16/32 take the tiled C++ path (AVX-512 builds), 64/80/128 the wide one
@pytest.mark.parametrize("head_dim,block_size", [(8, 16), (16, 8), (32, 16), (64, 16), (80, 1), (256, 32)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_decode_kernel_honours_the_window(head_dim, block_size, window, dtype):
    context_lens = [1, 15, 16, 17, 130, 513]
    batch = build_paged_batch(context_lens, [1] * len(context_lens), 1, head_dim, block_size, dtype,
                              torch.device("cpu"), poison=float("nan"))
    q = torch.randn(len(context_lens), 4, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale,
                                   window=window)
    assert_matches_reference(out, lambda q, k, v: paged_decode_reference(
        q, k, v, batch.block_tables, batch.context_lens, scale, window), q, batch.k_cache, batch.v_cache)


@pytest.mark.parametrize("window", [1, 20, 100])
def test_cpu_decode_kernel_honours_the_window_over_a_quantized_pool(window):
    context_lens = [3, 64, 250]
    batch = build_paged_batch(context_lens, [1] * 3, 2, 64, 16, torch.float32, torch.device("cpu"), poison=0.0)
    k_cache, v_cache = (ScaledCache(*quantize(cache, torch.int8)) for cache in (batch.k_cache, batch.v_cache))
    q = torch.randn(3, 4, 64)
    out = cpu_kernels.paged_decode(q, k_cache, v_cache, batch.block_tables, batch.context_lens, 0.125, window=window)
    expected = paged_decode_reference(q, k_cache, v_cache, batch.block_tables, batch.context_lens, 0.125, window)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 7, 64, 1000])
@pytest.mark.parametrize("decode_only", [False, True])
def test_torch_backend_honours_the_window(window, decode_only):
    steps = [(c, 1) for c, _ in MIXED] if decode_only else MIXED
    context_lens, query_lens = zip(*steps)
    batch = build_paged_batch(list(context_lens), list(query_lens), 2, 32, 16, torch.float32, torch.device("cpu"))
    q = torch.randn(sum(query_lens), 4, 32)
    meta = AttentionMetadata(
        slot_mapping=batch.slots, block_tables=batch.block_tables, context_lens=batch.context_lens,
        query_start_loc=batch.query_start_loc, query_lens_cpu=list(query_lens), context_lens_cpu=list(context_lens),
        max_query_len=max(query_lens), max_context_len=max(context_lens), block_size=16,
    )
    out = TorchAttentionBackend().attend(q, batch.k_cache, batch.v_cache, meta, 0.2, window)
    expected = ReferenceAttentionBackend().attend(q, batch.k_cache, batch.v_cache, meta, 0.2, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# head dims 8/16 with contexts from 8 * head dim take the tiled path's V pass by positions, whose
# tiles straddle the window's start here (first = 30, 113 with kTile 16)
@pytest.mark.parametrize("head_dim", [8, 16, 64])
@pytest.mark.parametrize("window", [100, 400])
def test_cpu_decode_kernel_ignores_nan_before_the_window(head_dim, window):
    context_lens = [130, 513]
    batch = build_paged_batch(context_lens, [1, 1], 1, head_dim, 16, torch.float32, torch.device("cpu"))
    q = torch.randn(2, 4, head_dim)
    scale = head_dim**-0.5
    expected = paged_decode_reference(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
                                      scale, window)
    # a freed block's rows before the window may hold anything: NaN there must not reach the output
    start = 0
    for ctx in context_lens:
        stale = batch.slots[start : start + max(0, ctx - window)]
        batch.k_cache.view(-1, head_dim)[stale] = float("nan")
        batch.v_cache.view(-1, head_dim)[stale] = float("nan")
        start += ctx
    out = cpu_kernels.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale,
                                   window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
