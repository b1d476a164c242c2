"""Varlen prefill/extend attention against its loop-per-sequence reference."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.kernel_cases import DTYPES, assert_matches_reference, build_paged_batch, case_id, grid, poisoned_like

from services.runtime.kernels.prefill_attention import prefill_attention, prefill_attention_reference

NUM_KV_HEADS = 2
# (context_len, query_len) per sequence: decode rows, whole prompts, a chunk over a cached
# prefix, a prefix-cache hit, and k+1 = 5 speculative tokens to verify
MIXED_BATCH = [
    (1, 1),  # decode of the first token
    (17, 17),  # whole prompt
    (97, 5),  # speculative verification over a cached prefix
    (257, 1),  # decode
    (1025, 16),  # prefill chunk after 1009 cached tokens
    (97, 64),  # prefix-cache hit: 33 cached tokens, 64 computed
]

CASES = grid(
    strength=3,  # every (head_dim, gqa, dtype) triple, and every triple of the other axes
    head_dim=[64, 80, 128],
    gqa=[1, 2, 4, 8],
    block_size=[16, 32],
    dtype=list(DTYPES),
)


def _run(batch, q, scale):
    out = poisoned_like(q)
    result = prefill_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, batch.query_start_loc, scale,
        max_query_len=batch.max_query_len, max_context_len=batch.max_context_len, out=out,
    )
    assert result is out
    return out


def _reference(batch, scale):
    return lambda q, k, v: prefill_attention_reference(q, k, v, batch.block_tables, batch.context_lens,
                                                       batch.query_start_loc, scale)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case, device):
    head_dim, dtype = case["head_dim"], case["dtype"]
    context_lens, query_lens = zip(*MIXED_BATCH)
    batch = build_paged_batch(list(context_lens), list(query_lens), NUM_KV_HEADS, head_dim,
                              case["block_size"], dtype, device)
    q = torch.randn(sum(query_lens), NUM_KV_HEADS * case["gqa"], head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    out = _run(batch, q, scale)
    assert_matches_reference(out, _reference(batch, scale), q, batch.k_cache, batch.v_cache)


@pytest.mark.parametrize("gqa", [1, 3, 8])
def test_long_prompts_span_several_query_tiles(gqa, device):
    """Whole prompts longer than one query tile (128 rows), a head ratio that is no power of two,
    and a q that is a strided view into a fused qkv projection."""
    context_lens = [300, 130]
    batch = build_paged_batch(context_lens, context_lens, 1, 64, 16, torch.float32, device)
    qkv = torch.randn(sum(context_lens), (gqa + 2) * 64, device=device)
    q = qkv[:, : gqa * 64].view(-1, gqa, 64)
    out = _run(batch, q, 0.125)
    assert_matches_reference(out, _reference(batch, 0.125), q, batch.k_cache, batch.v_cache)


def test_decode_only_batch_matches_decode_semantics(device):
    """With every query_len 1 the kernel is plain decode: each token sees its whole context."""
    batch = build_paged_batch([1, 33, 200], [1, 1, 1], 2, 64, 16, torch.float16, device)
    q = torch.randn(3, 4, 64, device=device).to(torch.float16)
    out = _run(batch, q, 0.125)
    assert_matches_reference(out, _reference(batch, 0.125), q, batch.k_cache, batch.v_cache)


@pytest.mark.parametrize("head_dim", [8, 16])
def test_small_head_dims(head_dim, device):
    """Head dims below tl.dot's minimum of 16 (the shipped stories260K model has 8) are padded."""
    batch = build_paged_batch([20, 70, 5], [20, 3, 1], 1, head_dim, 16, torch.float32, device)
    q = torch.randn(24, 8, head_dim, device=device)
    out = _run(batch, q, head_dim**-0.5)
    assert_matches_reference(out, _reference(batch, head_dim**-0.5), q, batch.k_cache, batch.v_cache)


def test_large_pool_offsets_do_not_overflow_int32(device):
    """As in the decode test: block ids past 2^22 with 1024-element blocks (element offsets past
    2^32) in an 8 GiB-per-cache fp16 pool that stays mostly unbacked on the CPU."""
    first_block_id = 2**22
    try:
        batch = build_paged_batch([70, 3], [20, 3], 1, 64, 16, torch.float16, device,
                                  num_blocks=first_block_id + 1024, first_block_id=first_block_id)
    except (RuntimeError, MemoryError) as error:  # reserving 16 GiB of address space can be refused
        pytest.skip(f"cannot reserve the large pool: {error}")
    assert int(batch.block_tables.max()) * 16 * 64 >= 2**32
    q = torch.randn(23, 2, 64, device=device).to(torch.float16)
    out = _run(batch, q, 0.125)
    used = batch.block_tables.long().unique()
    compact_tables = torch.searchsorted(used, batch.block_tables.long()).int()
    expected = prefill_attention_reference(q.float(), batch.k_cache[used].float(), batch.v_cache[used].float(),
                                           compact_tables, batch.context_lens, batch.query_start_loc, 0.125)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("breakage, message", [
    (lambda a: a.update(query_start_loc=a["query_start_loc"].long()), "query_start_loc must be contiguous int32"),
    (lambda a: a.update(query_start_loc=a["query_start_loc"][:2]), "query_start_loc must be contiguous int32"),
    (lambda a: a.update(max_query_len=0), "max_query_len must be in"),
    (lambda a: a.update(max_query_len=50), "max_query_len must be in"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :8]), "k_cache .* and v_cache .* differ"),
    (lambda a: a.update(context_lens=a["context_lens"].long()), "context_lens must be contiguous int32"),
])
def test_rejects_bad_inputs(breakage, message, device):
    batch = build_paged_batch([5, 40], [5, 3], 2, 32, 16, torch.float32, device)
    args = dict(q=torch.randn(8, 4, 32, device=device), k_cache=batch.k_cache, v_cache=batch.v_cache,
                block_tables=batch.block_tables, context_lens=batch.context_lens,
                query_start_loc=batch.query_start_loc, scale=0.1, max_query_len=5, max_context_len=40)
    breakage(args)
    with pytest.raises(ValueError, match=message):
        prefill_attention(**args)
