"""Gemma 2's soft-capped attention scores (``softcap * tanh(s / softcap)`` before the mask) in the
Triton decode and prefill kernels against the loop-per-sequence references, windowed and not,
with scores far past the cap; and the references against transformers' eager formula."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.kernel_cases import assert_matches_reference, build_paged_batch, poisoned_like

from services.runtime.kernels.paged_decode import paged_decode_attention, paged_decode_reference
from services.runtime.kernels.prefill_attention import prefill_attention, prefill_attention_reference

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
