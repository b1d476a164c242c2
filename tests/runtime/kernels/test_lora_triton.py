"""The batched-LoRA Triton kernels against the reference over awkward shapes (on CUDA, or in
the interpreter): ranks 1-64 with smaller effective ranks, rows of no adapter, one adapter for
every row, a single row, row counts and features that are no multiple of a block, a strided y."""

from __future__ import annotations

import pytest
import torch
from tests.helpers import lora_cases
from tests.helpers.kernel_cases import case_id

from services.runtime.kernels.lora import lora_apply, lora_reference, lora_triton


@pytest.mark.parametrize("case", lora_cases.CASES, ids=case_id)
def test_triton_kernels_match_the_reference(case, device):
    y, x, lora_a, lora_b, slots, scales = lora_cases.step(case, device=device)
    before = y.clone()
    expected = lora_reference(y.clone(), x, lora_a, lora_b, slots, scales)

    assert lora_triton(y, x, lora_a, lora_b, slots, scales) is y

    lora_cases.assert_matches_reference(y, expected, before, slots)


@pytest.mark.parametrize("out_splits, band_rank, b_layout, adapter_dtype", lora_cases.FUSED_CASES)
def test_triton_fused_projection(out_splits, band_rank, b_layout, adapter_dtype, device):
    y, x, lora_a, lora_b, slots, scales = lora_cases.fused_step(out_splits, band_rank, b_layout, adapter_dtype,
                                                                torch.bfloat16, device)
    before = y.clone()
    expected = lora_reference(y.clone(), x, lora_a, lora_b, slots, scales, out_splits)
    lora_triton(y, x, lora_a, lora_b, slots, scales, out_splits)
    lora_cases.assert_matches_reference(y, expected, before, slots)


def test_triton_fp16_activations_and_int64_slots(device):
    case = {"rows": "mixed", "rank": 8, "features": (40, 56), "dtype": torch.float16}
    y, x, lora_a, lora_b, slots, scales = lora_cases.step(case, device=device)
    before = y.clone()
    expected = lora_reference(y.clone(), x, lora_a, lora_b, slots, scales)
    lora_triton(y, x, lora_a, lora_b, slots.long(), scales)
    lora_cases.assert_matches_reference(y, expected, before, slots)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="lora_apply picks Triton on CUDA only")
def test_lora_apply_on_cuda_runs_triton():
    case = {"rows": "mixed", "rank": 16, "features": (576, 192), "dtype": torch.bfloat16}
    y, x, lora_a, lora_b, slots, scales = lora_cases.step(case, device="cuda")
    before = y.clone()
    expected = lora_reference(y.clone(), x, lora_a, lora_b, slots, scales)
    lora_apply(y, x, lora_a, lora_b, slots, scales)
    lora_cases.assert_matches_reference(y, expected, before, slots)
