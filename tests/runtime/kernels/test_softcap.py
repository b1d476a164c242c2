"""Gemma 2's soft-capped attention scores (``softcap * tanh(s / softcap)`` before the mask) in the
Triton decode and prefill kernels and the C++ CPU decode kernel against the loop-per-sequence references, windowed and not,
with scores far past the cap; and the references against transformers' eager formula."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.kernel_cases import assert_matches_reference, build_paged_batch, poisoned_like

from services.runtime.kernels import cpu as cpu_kernels
from services.runtime.kernels.kv_quant import ScaledCache, quantize
from services.runtime.kernels.paged_decode import paged_decode_attention, paged_decode_reference
from services.runtime.kernels.prefill_attention import prefill_attention, prefill_attention_reference
from services.runtime.model.attention.base import AttentionMetadata
from services.runtime.model.attention.cpu_backend import CpuAttentionBackend
from services.runtime.model.attention.torch_backend import TorchAttentionBackend

CAP = 5.0
MIXED = [(1, 1), (70, 70), (97, 5), (257, 40)]


def test_the_reference_caps_as_transformers_does():
    torch.manual_seed(0)
    batch = build_paged_batch([40], [40], 1, 16, 16, torch.float32, torch.device("cpu"))
    q = 4 * torch.randn(40, 2, 16)
    out = prefill_attention_reference(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
                                      batch.query_start_loc, 0.25, softcap=CAP)
    keys = batch.k_cache.view(-1, 1, 16)[batch.slots].expand(40, 2, 16)
    values = batch.v_cache.view(-1, 1, 16)[batch.slots].expand(40, 2, 16)
    scores = torch.einsum("lhd,chd->hlc", q, keys) * 0.25  # transformers' Gemma 2 eager attention
    scores = torch.tanh(scores / CAP) * CAP
    scores = scores.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hlc,chd->lhd", torch.softmax(scores, dim=-1), values)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert (torch.einsum("lhd,chd->hlc", q, keys).abs() * 0.25 > 2 * CAP).any()  # scores the cap bends


@pytest.mark.parametrize("window", [None, 7, 64])
@pytest.mark.parametrize("head_dim,gqa,dtype", [(64, 2, torch.float32), (256, 4, torch.bfloat16)])
def test_triton_prefill_caps_scores(window, head_dim, gqa, dtype, device):
    torch.manual_seed(1)
    context_lens, query_lens = zip(*MIXED)
    batch = build_paged_batch(list(context_lens), list(query_lens), 1, head_dim, 16, dtype, device)
    q = (4 * torch.randn(sum(query_lens), gqa, head_dim, device=device)).to(dtype)
    scale = head_dim**-0.5
    out = poisoned_like(q)
    prefill_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, batch.query_start_loc,
                      scale, max_query_len=batch.max_query_len, max_context_len=batch.max_context_len, out=out,
                      window=window, softcap=CAP)
    assert_matches_reference(out, lambda q, k, v: prefill_attention_reference(
        q, k, v, batch.block_tables, batch.context_lens, batch.query_start_loc, scale, window, softcap=CAP),
        q, batch.k_cache, batch.v_cache)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("num_partitions", [1, 3])
def test_triton_decode_caps_scores(window, num_partitions, device):
    torch.manual_seed(2)
    context_lens = [1, 17, 300, 64]
    batch = build_paged_batch(context_lens, [1] * len(context_lens), 2, 64, 16, torch.float32, device)
    q = 4 * torch.randn(len(context_lens), 4, 64, device=device)
    out = paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
                                 max_context_len=batch.max_context_len, num_partitions=num_partitions, window=window,
                                 softcap=CAP)
    assert_matches_reference(out, lambda q, k, v: paged_decode_reference(
        q, k, v, batch.block_tables, batch.context_lens, 0.125, window, softcap=CAP), q, batch.k_cache, batch.v_cache)
    uncapped = paged_decode_reference(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
                                      window)
    assert (out - uncapped).abs().max() > 1e-2  # the cap changed the answer: the test can fail


# The C++ CPU decode kernel: head dims 8/16/32 take its tiled path (AVX-512 builds), 64/80/256 the
# wide one; block edges, a block size of 1 and 7, MQA and GQA, windows cutting into the context.
@pytest.mark.parametrize("head_dim,block_size,kv_heads", [(8, 16, 1), (16, 7, 2), (32, 16, 1), (64, 1, 2),
                                                          (80, 16, 1), (256, 32, 1)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_decode_kernel_caps_scores(head_dim, block_size, kv_heads, window, dtype):
    torch.manual_seed(head_dim + block_size)
    context_lens = [1, 15, 16, 17, 130, 300]
    batch = build_paged_batch(context_lens, [1] * len(context_lens), kv_heads, head_dim, block_size, dtype,
                              torch.device("cpu"), poison=float("nan"))
    q = (4 * torch.randn(len(context_lens), 4, head_dim)).to(dtype)  # scores far past the cap
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale,
                                   window=window, softcap=CAP)
    assert_matches_reference(out, lambda q, k, v: paged_decode_reference(
        q, k, v, batch.block_tables, batch.context_lens, scale, window, softcap=CAP), q, batch.k_cache, batch.v_cache)
    uncapped = paged_decode_reference(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale,
                                      window)
    assert (out.float() - uncapped.float()).abs().max() > 1e-2  # the cap changed the answer: the test can fail


@pytest.mark.parametrize("window", [None, 20])
def test_cpu_decode_kernel_caps_scores_over_a_quantized_pool(window):
    torch.manual_seed(3)
    context_lens = [3, 64, 250]
    batch = build_paged_batch(context_lens, [1] * 3, 2, 64, 16, torch.float32, torch.device("cpu"), poison=0.0)
    k_cache, v_cache = (ScaledCache(*quantize(cache, torch.int8)) for cache in (batch.k_cache, batch.v_cache))
    q = 4 * torch.randn(3, 4, 64)
    out = cpu_kernels.paged_decode(q, k_cache, v_cache, batch.block_tables, batch.context_lens, 0.125, window=window,
                                   softcap=CAP)
    expected = paged_decode_reference(q, k_cache, v_cache, batch.block_tables, batch.context_lens, 0.125, window,
                                      softcap=CAP)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_cpu_decode_kernel_refuses_a_bad_cap():
    batch = build_paged_batch([5], [1], 1, 64, 16, torch.float32, torch.device("cpu"))
    q = torch.randn(1, 2, 64)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(RuntimeError, match="softcap"):
            cpu_kernels.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.125,
                                     softcap=bad)


@pytest.mark.parametrize("decode_only", [True, False])
def test_cpu_backend_caps_decode_rows_in_the_kernel(decode_only):
    """A decode-only step's capped rows run in the C++ kernel, a mixed step's in torch: both equal
    the torch backend's capped path (transformers' eager formula, checked above)."""
    steps = [(c, 1) for c, _ in MIXED] if decode_only else MIXED
    context_lens, query_lens = zip(*steps)
    batch = build_paged_batch(list(context_lens), list(query_lens), 1, 256, 16, torch.float32, torch.device("cpu"))
    q = 4 * torch.randn(sum(query_lens), 4, 256)
    meta = AttentionMetadata(
        slot_mapping=batch.slots, block_tables=batch.block_tables, context_lens=batch.context_lens,
        query_start_loc=batch.query_start_loc, query_lens_cpu=list(query_lens), context_lens_cpu=list(context_lens),
        max_query_len=max(query_lens), max_context_len=max(context_lens), block_size=16,
    )
    out = CpuAttentionBackend().attend(q, batch.k_cache, batch.v_cache, meta, 0.0625, 64, softcap=CAP)
    expected = TorchAttentionBackend().attend(q, batch.k_cache, batch.v_cache, meta, 0.0625, 64, softcap=CAP)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
