"""Batched LoRA on the CPU: the reference against the merged-weight form of each row's adapter,
and the C++ kernel (what ``lora_apply`` runs on a CPU) against the reference over awkward shapes.
The Triton kernels' tests are in test_lora_triton.py (this file also runs in the AVX2-only build)."""

from __future__ import annotations

import pytest
import torch
from tests.helpers import lora_cases
from tests.helpers.kernel_cases import case_id

from services.runtime.kernels import lora
from services.runtime.kernels.lora import LoraStack, lora_apply, lora_reference


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


def test_reference_of_a_fused_projection_is_the_block_diagonal_adapter():
    out_splits = [64, 24, 24]
    y, x, lora_a, lora_b, slots, scales = lora_cases.fused_step(out_splits, 8, "peft", torch.float32)
    expected = lora_reference(y.clone(), x, lora_a, lora_cases.block_diagonal(lora_b, out_splits), slots, scales)
    lora_reference(y, x, lora_a, lora_b, slots, scales, out_splits)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"out_splits \(64, 24, 23\) must be positive widths summing to y's 112"):
        lora_reference(y, x, lora_a, lora_b, slots, scales, (64, 24, 23))


@pytest.mark.parametrize("out_splits, band_rank, b_layout, adapter_dtype", lora_cases.FUSED_CASES)
def test_cpu_kernel_fused_projection(out_splits, band_rank, b_layout, adapter_dtype, cpu_ops):
    y, x, lora_a, lora_b, slots, scales = lora_cases.fused_step(out_splits, band_rank, b_layout, adapter_dtype)
    before = y.clone()
    expected = lora_reference(y.clone(), x, lora_a, lora_b, slots, scales, out_splits)
    assert cpu_ops.lora_apply(y, x, lora_a, lora_b, slots, scales, out_splits) == -1
    lora_cases.assert_matches_reference(y, expected, before, slots)


def test_reference_refuses_a_slot_outside_the_stack():
    lora_a, lora_b, scales = _adapters(2, 4, 8, 8)
    with pytest.raises(ValueError, match=r"row_slots\[1\] = 2 must be -1 \(no adapter\) or a slot in \[0, 2\)"):
        lora_reference(torch.zeros(3, 8), torch.zeros(3, 8), lora_a, lora_b, torch.tensor([0, 2, -1]), scales)
    with pytest.raises(ValueError, match=r"lora_b must be \[2, 9, 4\]"):
        lora_reference(torch.zeros(3, 9), torch.zeros(3, 8), lora_a, lora_b, torch.tensor([0, 1, -1]), scales)


@pytest.fixture(scope="module")
def cpu_ops():
    ops = lora._cpu_ops()
    assert ops is not None, "the C++ CPU kernels did not build"
    return ops


@pytest.mark.parametrize("case", lora_cases.CASES, ids=case_id)
def test_cpu_kernel_matches_the_reference(case, cpu_ops):
    y, x, lora_a, lora_b, slots, scales = lora_cases.step(case)
    before = y.clone()
    expected = lora_reference(y.clone(), x, lora_a, lora_b, slots, scales)

    assert cpu_ops.lora_apply(y, x, lora_a, lora_b, slots, scales, [y.shape[1]]) == -1

    lora_cases.assert_matches_reference(y, expected, before, slots)


def test_lora_apply_runs_the_cpu_kernel_and_falls_back_where_it_does_not_fit(cpu_ops, monkeypatch):
    case = {"rows": "mixed", "rank": 16, "features": (72, 200), "dtype": torch.float32}
    y, x, lora_a, lora_b, slots, scales = lora_cases.step(case)
    expected = lora_reference(y.clone(), x, lora_a, lora_b, slots.long(), scales)
    calls = []
    monkeypatch.setattr(lora, "lora_reference", lambda *args: calls.append(args) or lora_reference(*args))

    assert lora_apply(y, x, lora_a, lora_b, slots.long(), scales) is y
    assert not calls  # int64 slots and a strided y still take the kernel
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)

    y16 = torch.zeros(37, 200, dtype=torch.float16)
    lora_apply(y16, x.half(), lora_a.half(), lora_b.half(), slots, scales)  # fp16 adapters: the reference
    assert len(calls) == 1


def test_cpu_kernel_refuses_a_slot_outside_the_stack_and_writes_nothing(cpu_ops):
    lora_a, lora_b, scales = _adapters(2, 4, 8, 8)
    y = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"row_slots\[2\] = -2 must be -1 \(no adapter\) or a slot in \[0, 2\)"):
        lora_apply(y, torch.ones(3, 8), lora_a, lora_b, torch.tensor([0, 1, -2], dtype=torch.int32), scales)
    assert not y.any()


def test_stack_checked_once_applies_like_lora_apply(cpu_ops):
    out_splits = (64, 24, 24)
    y, x, lora_a, lora_b, slots, scales = lora_cases.fused_step(list(out_splits), 8, "rank_major", torch.float32)
    stack = LoraStack(lora_a, lora_b, scales, out_splits)
    expected = lora_reference(y.clone(), x, lora_a, lora_b, slots, scales, out_splits)

    assert stack.apply(y, x, slots) is y

    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"x must be \[T, in\] and y \[T, out\] with the same T"):
        stack.apply(y, x[:-1], slots)
    with pytest.raises(ValueError, match=r"lora_b must be \[3, 112, 24\]"):
        LoraStack(lora_a, lora_b, scales)  # no out_splits: B would need every rank
