"""reshape_and_cache against its token-by-token reference: exact copies, padding skipped."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.kernel_cases import DTYPES, case_id, grid

from services.runtime.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_reference

CASES = grid(dtype=list(DTYPES), kv_heads=[1, 2, 8], head_dim=[64, 80, 128], block_size=[16, 32])


def _poisoned_pool(num_blocks, block_size, kv_heads, head_dim, dtype, device):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, float("nan"), dtype=dtype, device=device))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case, device):
    dtype, kv_heads, head_dim, block_size = case["dtype"], case["kv_heads"], case["head_dim"], case["block_size"]
    num_blocks, num_tokens = 12, 37
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[3, 17, 36]] = -1  # padding tokens
    slots = slots.to(device)
    # k and v as strided views into a fused qkv projection, as the model hands them over
    qkv = torch.randn(num_tokens, 3 * kv_heads * head_dim, device=device).to(dtype)
    k = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim :].view(num_tokens, kv_heads, head_dim)
    k_cache, v_cache = _poisoned_pool(num_blocks, block_size, kv_heads, head_dim, dtype, device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()

    reshape_and_cache(k, v, k_cache, v_cache, slots)
    reshape_and_cache_reference(k, v, k_expected, v_expected, slots)

    torch.testing.assert_close(k_cache, k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, atol=0, rtol=0, equal_nan=True)
    assert int((~k_cache.isnan()).sum()) == (num_tokens - 3) * kv_heads * head_dim  # padding wrote nothing


def test_large_slot_ids(device):
    """Slots past 2^32 elements of an 8 GiB fp16 pool (mostly unbacked on the CPU)."""
    block_size, kv_heads, head_dim = 16, 1, 64
    num_blocks = 2**22 + 64
    try:
        k_cache = torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=torch.float16, device=device)
        v_cache = torch.empty_like(k_cache)
    except (RuntimeError, MemoryError) as error:
        pytest.skip(f"cannot reserve the large pool: {error}")
    low, top = slice(0, 64), slice(num_blocks - 64, num_blocks)
    for cache in (k_cache, v_cache):
        cache[low] = float("nan")
        cache[top] = float("nan")
    slots = (num_blocks - 64) * block_size + torch.randperm(64 * block_size)[:50].to(device)
    k = torch.randn(50, kv_heads, head_dim, device=device).half()
    v = torch.randn(50, kv_heads, head_dim, device=device).half()
    reshape_and_cache(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    torch.testing.assert_close(flat_k[slots], k, atol=0, rtol=0)
    torch.testing.assert_close(flat_v[slots], v, atol=0, rtol=0)
    assert k_cache[low].isnan().all() and v_cache[low].isnan().all()  # nothing wrapped around


@pytest.mark.parametrize("breakage, message", [
    (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping must be contiguous int64"),
    (lambda a: a.update(k=a["k"].half()), "k_cache must match k"),
    (lambda a: a.update(v=a["v"][:, :1]), "k .* and v .* differ"),
    (lambda a: a.update(k_cache=a["k_cache"][..., :16]), "heads/head_dim"),
])
def test_rejects_bad_inputs(breakage, message, device):
    args = dict(k=torch.randn(4, 2, 32, device=device), v=torch.randn(4, 2, 32, device=device),
                k_cache=torch.zeros(3, 16, 2, 32, device=device), v_cache=torch.zeros(3, 16, 2, 32, device=device),
                slot_mapping=torch.arange(4, device=device))
    breakage(args)
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(**args)
