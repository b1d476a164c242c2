"""Attention backends through the AttentionBackend interface: write the step's K/V, then attend,
compared with ReferenceAttentionBackend on a copy of the same pool."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.kernel_cases import assert_matches_reference, build_paged_batch

from services.runtime.model.attention.base import AttentionMetadata
from services.runtime.model.attention.cpu_backend import CpuAttentionBackend
from services.runtime.model.attention.reference_backend import ReferenceAttentionBackend
from services.runtime.model.attention.torch_backend import TorchAttentionBackend
from services.runtime.model.attention.triton_backend import TritonAttentionBackend

STEPS = {
    "decode-only": [(1, 1), (40, 1), (300, 1)],
    "mixed": [(1, 1), (50, 50), (97, 5), (300, 1), (130, 33)],
}


def _step(batch, device) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=batch.new_token_slots(),
        block_tables=batch.block_tables,
        context_lens=batch.context_lens,
        query_start_loc=batch.query_start_loc,
        query_lens_cpu=list(batch.query_lens),
        context_lens_cpu=batch.context_lens.tolist(),
        max_query_len=batch.max_query_len,
        max_context_len=batch.max_context_len,
        block_size=batch.k_cache.shape[1],
    )


@pytest.mark.parametrize("backend_cls", [TritonAttentionBackend, TorchAttentionBackend, CpuAttentionBackend],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backend_matches_reference(backend_cls, step, dtype, device):
    if backend_cls is CpuAttentionBackend and device.type != "cpu":
        pytest.skip("the cpu backend runs on the CPU only")
    context_lens, query_lens = zip(*STEPS[step])
    kv_heads, heads, head_dim = 2, 8, 64
    # Slots a sequence does not own hold NaN: the triton kernels must never read them, and the
    # torch backend (which gathers whole blocks) must keep them out of its sums.
    batch = build_paged_batch(list(context_lens), list(query_lens), kv_heads, head_dim, 16, dtype, device,
                              poison=float("nan"))
    meta = _step(batch, device)
    assert meta.is_decode_only == (step == "decode-only")
    num_tokens = sum(query_lens)
    k_new = torch.randn(num_tokens, kv_heads, head_dim, device=device).to(dtype)
    v_new = torch.randn(num_tokens, kv_heads, head_dim, device=device).to(dtype)
    q = torch.randn(num_tokens, heads, head_dim, device=device).to(dtype)
    for cache in (batch.k_cache, batch.v_cache):  # the new tokens' slots: only write_kv fills them
        cache.view(-1, kv_heads, head_dim)[meta.slot_mapping] = float("nan")
    reference = ReferenceAttentionBackend()
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(k_new, v_new, ref_k, ref_v, meta)

    backend = backend_cls()
    backend.write_kv(k_new, v_new, batch.k_cache, batch.v_cache, meta)
    out = backend.attend(q, batch.k_cache, batch.v_cache, meta, head_dim**-0.5)

    torch.testing.assert_close(batch.k_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(batch.v_cache, ref_v, atol=0, rtol=0, equal_nan=True)
    assert out.shape == q.shape and out.dtype == dtype
    assert_matches_reference(out, lambda q, k, v: reference.attend(q, k, v, meta, head_dim**-0.5), q, ref_k, ref_v)


def test_backend_names():
    assert TritonAttentionBackend.name == "triton"
    assert ReferenceAttentionBackend.name == "reference"
