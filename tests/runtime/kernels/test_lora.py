"""Batched LoRA: the reference against the merged-weight form of each row's adapter, and
``lora_apply`` against the reference over awkward shapes."""

from __future__ import annotations

import pytest
import torch

from services.runtime.kernels.lora import lora_apply, lora_reference


def _adapters(num_slots: int, rank: int, in_features: int, out_features: int, ranks: list[int] | None = None,
              device: str | torch.device = "cpu"):
    """Random A [S, R, in] and B [S, out, R], slot s zero-padded beyond its rank ranks[s]."""
    lora_a = torch.randn(num_slots, rank, in_features, device=device) / in_features**0.5
    lora_b = torch.randn(num_slots, out_features, rank, device=device)
    for slot, effective in enumerate(ranks or []):
        lora_a[slot, effective:] = 0
        lora_b[slot, :, effective:] = 0
    scales = torch.rand(num_slots, device=device) + 0.5
    return lora_a, lora_b, scales


def test_reference_is_each_rows_merged_adapter():
    in_features, out_features = 24, 40
    lora_a, lora_b, scales = _adapters(3, 8, in_features, out_features, ranks=[8, 3, 1])
    x = torch.randn(7, in_features)
    y = torch.randn(7, out_features)
    row_slots = torch.tensor([2, -1, 0, 0, 1, -1, 2], dtype=torch.int32)
    expected = y.clone()
    for t, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            merged = scales[slot] * lora_b[slot] @ lora_a[slot]  # [out, in], what peft's merge adds to W
            expected[t] += merged @ x[t]

    returned = lora_reference(y, x, lora_a, lora_b, row_slots, scales)

    assert returned is y
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_reference_refuses_a_slot_outside_the_stack():
    lora_a, lora_b, scales = _adapters(2, 4, 8, 8)
    with pytest.raises(ValueError, match=r"row_slots\[1\] = 2 must be -1 \(no adapter\) or a slot in \[0, 2\)"):
        lora_reference(torch.zeros(3, 8), torch.zeros(3, 8), lora_a, lora_b, torch.tensor([0, 2, -1]), scales)
    with pytest.raises(ValueError, match=r"lora_b must be \[2, 9, 4\]"):
        lora_reference(torch.zeros(3, 9), torch.zeros(3, 8), lora_a, lora_b, torch.tensor([0, 1, -1]), scales)


@pytest.mark.parametrize("slots", [[-1, -1, -1], [1, 1, 1], [0], [1, -1, 0, 1]])
def test_lora_apply_matches_the_reference(slots):
    lora_a, lora_b, scales = _adapters(2, 16, 40, 56, ranks=[16, 5])
    x = torch.randn(len(slots), 40)
    y = torch.randn(len(slots), 56)
    row_slots = torch.tensor(slots)
    expected = lora_reference(y.clone(), x, lora_a, lora_b, row_slots, scales)
    assert lora_apply(y, x, lora_a, lora_b, row_slots, scales) is y
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
