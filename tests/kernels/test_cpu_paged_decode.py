"""The C++ CPU paged decode kernel against paged_decode_reference, and the cpu backend through
the AttentionBackend interface.

The kernel is compiled by this test run if ``make install`` has not built it already. If it
cannot be built here the tests fail (they do not skip): on every machine the project
supports, a C++ compiler is part of the install.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_matches_reference, build_paged_batch

from services.common.kernels import cpu as cpu_kernels
from services.common.kernels.paged_decode import paged_decode_reference
from services.common.model.attention.registry import get_attention_backend, resolve_backend_name

CASES = [
    # (context lens, kv_heads, heads, head_dim, block_size)
    ([1], 1, 1, 64, 16),
    ([1, 2, 15, 16, 17], 2, 8, 64, 16),          # block edges
    ([300, 7, 1025, 64], 4, 4, 128, 32),         # MHA, long contexts
    ([33, 250, 99], 1, 8, 80, 16),               # MQA, head_dim not a power of two
    ([5, 129, 512, 3, 77, 200], 4, 12, 64, 16),  # the benchmark model's shape (GQA 12/4)
    ([40, 41], 8, 8, 64, 1),                     # block size 1
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ctx{len(c[0])}-kv{c[1]}-h{c[2]}-d{c[3]}-bs{c[4]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kernel_matches_reference(case, dtype):
    context_lens, kv_heads, heads, head_dim, block_size = case
    # Every slot a sequence does not own holds NaN: the kernel must read only its own slots.
    batch = build_paged_batch(context_lens, [1] * len(context_lens), kv_heads, head_dim, block_size, dtype,
                              torch.device("cpu"), poison=float("nan"))
    q = torch.randn(len(context_lens), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert_matches_reference(
        out, lambda q, k, v: paged_decode_reference(q, k, v, batch.block_tables, batch.context_lens, scale),
        q, batch.k_cache, batch.v_cache,
    )


def test_kernel_reads_only_through_the_block_table():
    # Two sequences share nothing; swapping the blocks of one in the pool (and its table) must
    # not change either output.
    torch.manual_seed(0)
    k = torch.randn(8, 4, 2, 16)
    v = torch.randn(8, 4, 2, 16)
    q = torch.randn(2, 4, 16)
    tables = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 6], dtype=torch.int32)
    before = cpu_kernels.paged_decode(q, k, v, tables, lens, 0.25)
    k2, v2 = k.clone(), v.clone()
    k2[[5, 6]], v2[[5, 6]] = k[[0, 1]], v[[0, 1]]
    k2[[0, 1]] = float("nan")
    v2[[0, 1]] = float("nan")
    k2[7], v2[7] = k[2], v[2]
    after = cpu_kernels.paged_decode(q[:1], k2, v2, torch.tensor([[5, 6, 7]], dtype=torch.int32), lens[:1], 0.25)
    torch.testing.assert_close(after, before[:1], rtol=0, atol=0)


@pytest.mark.parametrize("bad", ["short_table", "zero_len", "dtype", "block_outside_pool", "negative_block"])
def test_kernel_refuses_inconsistent_inputs(bad):
    k = torch.zeros(4, 16, 2, 64)
    q = torch.zeros(1, 4, 64)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([20], dtype=torch.int32)
    if bad == "short_table":
        lens = torch.tensor([33], dtype=torch.int32)  # needs 3 blocks, the table has 2
    elif bad == "zero_len":
        lens = torch.tensor([0], dtype=torch.int32)
    elif bad == "block_outside_pool":
        tables = torch.tensor([[0, 4]], dtype=torch.int32)  # the pool has blocks 0..3
    elif bad == "negative_block":
        tables = torch.tensor([[-1, 0]], dtype=torch.int32)
    else:
        q = q.half()
    with pytest.raises(RuntimeError, match="context_lens|dtype|outside the pool"):
        cpu_kernels.paged_decode(q, k, k.clone(), tables, lens, 0.125)


def test_auto_backend_on_cpu_is_the_cpu_kernel():
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    assert get_attention_backend("auto", torch.device("cpu")).name == "cpu"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_backend_name("cpu", torch.device("cuda"))
