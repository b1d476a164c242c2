"""Paged decode attention against its loop-per-sequence reference."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.kernel_cases import DTYPES, assert_matches_reference, build_paged_batch, case_id, grid, poisoned_like

from services.runtime.kernels.paged_decode import choose_num_partitions, paged_decode_attention, paged_decode_reference

CONTEXT_LENS = [1, 17, 97, 257, 1025]
NUM_KV_HEADS = 2

CASES = grid(
    strength=3,  # every (head_dim, gqa, dtype) triple, and every triple of the other axes
    head_dim=[64, 80, 128],
    gqa=[1, 2, 4, 8],
    block_size=[16, 32],
    dtype=list(DTYPES),
    partitions=[1, 5],
)


def _run(batch, q, scale, num_partitions):
    out = poisoned_like(q)
    result = paged_decode_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale,
        max_context_len=batch.max_context_len, num_partitions=num_partitions, out=out,
    )
    assert result is out
    return out


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case, device):
    head_dim, dtype = case["head_dim"], case["dtype"]
    batch = build_paged_batch(CONTEXT_LENS, [1] * len(CONTEXT_LENS), NUM_KV_HEADS, head_dim,
                              case["block_size"], dtype, device)
    q = torch.randn(len(CONTEXT_LENS), NUM_KV_HEADS * case["gqa"], head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    out = _run(batch, q, scale, case["partitions"])
    assert_matches_reference(out, lambda q, k, v: paged_decode_reference(q, k, v, batch.block_tables,
                                                                         batch.context_lens, scale),
                             q, batch.k_cache, batch.v_cache)


@pytest.mark.parametrize("num_partitions", [2, 7, 64])
def test_split_k_equals_single_pass(num_partitions, device):
    """Partitions must combine to the one-pass result, empty ones included (the launcher caps the
    count at one 64-token tile each, so 64 asked for a 300-token max run as 5; the 3-token
    sequence then has nothing in four of them)."""
    batch = build_paged_batch([300, 3, 64, 65], [1] * 4, 2, 64, 16, torch.float32, device)
    q = torch.randn(4, 4, 64, device=device)
    single = _run(batch, q, 0.125, 1)
    split = _run(batch, q, 0.125, num_partitions)
    torch.testing.assert_close(split, single, atol=1e-6, rtol=1e-5)


def test_large_pool_offsets_do_not_overflow_int32(device):
    """Block ids past 2^22 in a pool of 1024-element blocks put element offsets past 2^32: with
    int32 arithmetic they wrap to the pool's first (NaN-poisoned) blocks. The fp16 pool is 8 GiB
    of address space per cache; on the CPU only the touched pages are ever backed by memory."""
    block_size, kv_heads, head_dim = 16, 1, 64
    first_block_id = 2**22
    try:
        batch = build_paged_batch([33, 200, 1], [1, 1, 1], kv_heads, head_dim, block_size, torch.float16, device,
                                  num_blocks=first_block_id + 1024, first_block_id=first_block_id)
    except (RuntimeError, MemoryError) as error:  # reserving 16 GiB of address space can be refused
        pytest.skip(f"cannot reserve the large pool: {error}")
    assert int(batch.block_tables.max()) * block_size * kv_heads * head_dim >= 2**32
    q = torch.randn(3, 4, head_dim, device=device).to(torch.float16)
    out = _run(batch, q, 0.125, 2)
    # the reference runs on a compact copy of just the used blocks (the whole pool would not fit)
    used = batch.block_tables.long().unique()
    compact_tables = torch.searchsorted(used, batch.block_tables.long()).int()
    expected = paged_decode_reference(q.float(), batch.k_cache[used].float(), batch.v_cache[used].float(),
                                      compact_tables, batch.context_lens, 0.125)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("head_dim", [8, 16])
def test_small_head_dims(head_dim, device):
    """Head dims below tl.dot's minimum of 16 (the shipped stories260K model has 8) are padded."""
    batch = build_paged_batch([1, 20, 70], [1, 1, 1], 1, head_dim, 16, torch.float32, device)
    q = torch.randn(3, 8, head_dim, device=device)
    out = _run(batch, q, head_dim**-0.5, 2)
    assert_matches_reference(out, lambda q, k, v: paged_decode_reference(q, k, v, batch.block_tables,
                                                                         batch.context_lens, head_dim**-0.5),
                             q, batch.k_cache, batch.v_cache)


def test_choose_num_partitions():
    assert choose_num_partitions(num_seqs=256, num_kv_heads=8, max_context_len=32768, num_sms=132) == 1
    assert choose_num_partitions(num_seqs=1, num_kv_heads=8, max_context_len=32768, num_sms=132) == 66
    assert choose_num_partitions(num_seqs=1, num_kv_heads=8, max_context_len=600, num_sms=132) == 3
    assert choose_num_partitions(num_seqs=4, num_kv_heads=1, max_context_len=1, num_sms=1) == 1


@pytest.mark.parametrize("breakage, message", [
    (lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), "unit last stride"),
    (lambda a: a.update(k_cache=a["k_cache"].half()), "k_cache must match q"),
    (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must be int32"),
    (lambda a: a.update(context_lens=a["context_lens"][:1]), "context_lens must be contiguous int32"),
    (lambda a: a.update(q=a["q"][:, :3]), "multiple of kv heads"),
    (lambda a: a.update(max_context_len=10_000), "max_context_len must be in"),
    (lambda a: a.update(num_partitions=0), "num_partitions must be >= 1"),
    (lambda a: a.update(out=torch.empty(2, 4, 16)), "out must be"),
])
def test_rejects_bad_inputs(breakage, message, device):
    batch = build_paged_batch([5, 40], [1, 1], 2, 32, 16, torch.float32, device)
    args = dict(q=torch.randn(2, 4, 32, device=device), k_cache=batch.k_cache, v_cache=batch.v_cache,
                block_tables=batch.block_tables, context_lens=batch.context_lens, scale=0.1,
                max_context_len=40, num_partitions=1, out=None)
    breakage(args)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)
