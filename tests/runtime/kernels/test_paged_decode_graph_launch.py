"""Paged decode launched the way a captured CUDA graph launches it.

A decode graph fixes the host-side arguments at capture (services/runtime/model/decode_graphs.py):
``max_context_len`` is the longest context the executor serves, so the partition size and count
follow it, while the real contexts are far shorter and vary per replay; padding rows are
one-token sequences in a scratch block. The kernel must give the reference's result anyway.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.kernel_cases import assert_matches_reference, build_paged_batch

from services.runtime.kernels.paged_decode import choose_num_partitions, paged_decode_attention, paged_decode_reference


@pytest.mark.parametrize("max_model_len,num_sms", [(2048, 132), (4096, 8), (512, 1)])
def test_capture_time_lengths_give_the_reference_for_any_shorter_contexts(max_model_len, num_sms, device):
    context_lens = [1, 70, 300, 1, 1]  # the last two play padding rows
    batch = build_paged_batch(context_lens, [1] * len(context_lens), 2, 64, 16, torch.float32, device)
    q = torch.randn(len(context_lens), 8, 64, device=device)
    partitions = choose_num_partitions(len(context_lens), 2, max_model_len, num_sms)
    # The graph's table is as wide as the longest context; columns past a row's blocks hold stale ids.
    tables = torch.zeros((len(context_lens), -(-max_model_len // 16)), dtype=torch.int32, device=device)
    tables[:, : batch.block_tables.shape[1]] = batch.block_tables
    out = paged_decode_attention(q, batch.k_cache, batch.v_cache, tables, batch.context_lens, 0.125,
                                 max_context_len=max_model_len, num_partitions=partitions)
    assert_matches_reference(out, lambda q, k, v: paged_decode_reference(q, k, v, batch.block_tables,
                                                                         batch.context_lens, 0.125),
                             q, batch.k_cache, batch.v_cache)
