"""Helpers of the batched-LoRA kernel tests: random adapter stacks and step rows over awkward shapes."""

from __future__ import annotations

import torch

from tests.helpers.kernel_cases import grid

ROW_PATTERNS = ("mixed", "no_adapter", "one_adapter", "single_row")
"""mixed: 37 rows over every slot and none, interleaved; no_adapter: every row -1; one_adapter:
every row on slot 1; single_row: one row."""

CASES = grid(
    strength=2,
    rows=list(ROW_PATTERNS),
    rank=[1, 7, 16, 64],
    features=[(40, 56), (72, 200), (576, 192)],  # (in, out): none a multiple of 64, some not of 16
    dtype=[torch.float32, torch.bfloat16],
    b_layout=["peft", "rank_major"],  # lora_b contiguous [S, out, R], or the transposed view of [S, R, out]
    adapter_dtype=[torch.float32, torch.bfloat16],  # how the adapters are stored
)

ROUNDING_STEP = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def adapters(num_slots: int, rank: int, in_features: int, out_features: int, device: str | torch.device = "cpu"):
    """A [S, R, in] and B [S, out, R] fp32, slot s zero-padded past an effective rank that
    shrinks with s (rank, rank // 2, ..., at least 1); scales [S] fp32."""
    lora_a = torch.randn(num_slots, rank, in_features, device=device) / in_features**0.5
    lora_b = torch.randn(num_slots, out_features, rank, device=device) / rank**0.5
    for slot in range(num_slots):
        effective = max(1, rank >> slot)
        lora_a[slot, effective:] = 0
        lora_b[slot, :, effective:] = 0
    scales = torch.rand(num_slots, device=device) + 0.5
    return lora_a, lora_b, scales


def row_slots(pattern: str, num_slots: int, device: str | torch.device = "cpu") -> torch.Tensor:
    if pattern == "mixed":
        slots = [(t * 5) % (num_slots + 1) - 1 for t in range(37)]  # every slot and -1, interleaved
    elif pattern == "no_adapter":
        slots = [-1] * 19
    elif pattern == "one_adapter":
        slots = [1] * 21
    else:
        slots = [num_slots - 1]
    return torch.tensor(slots, dtype=torch.int32, device=device)


def step(case: dict, num_slots: int = 4, device: str | torch.device = "cpu"):
    """(y, x, lora_a, lora_b, row_slots, scales) of a case; y is a column view of a wider tensor
    (a fused projection's output) and x's rows of slot -1 are NaN, which no kernel may read."""
    in_features, out_features = case["features"]
    lora_a, lora_b, scales = adapters(num_slots, case["rank"], in_features, out_features, device)
    adapter_dtype = case.get("adapter_dtype", torch.float32)
    lora_a, lora_b = lora_a.to(adapter_dtype), lora_b.to(adapter_dtype)
    if case.get("b_layout") == "rank_major":
        lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    slots = row_slots(case["rows"], num_slots, device)
    num_rows = slots.shape[0]
    x = torch.randn(num_rows, in_features, device=device).to(case["dtype"])
    x[slots < 0] = float("nan")
    wide = torch.randn(num_rows, out_features + 24, device=device).to(case["dtype"])
    y = wide[:, 8 : 8 + out_features]
    return y, x, lora_a, lora_b, slots, scales


def assert_matches_reference(y: torch.Tensor, expected: torch.Tensor, before: torch.Tensor,
                             slots: torch.Tensor) -> None:
    """Within one rounding step of y's dtype; rows without an adapter bit-for-bit unchanged."""
    step_size = ROUNDING_STEP[y.dtype]
    torch.testing.assert_close(y.float(), expected.float(), atol=step_size, rtol=step_size)
    untouched = slots < 0
    torch.testing.assert_close(y[untouched], before[untouched], atol=0, rtol=0)


def block_diagonal(lora_b: torch.Tensor, out_splits: list[int]) -> torch.Tensor:
    """[S, out, R] with per-band rows -> [S, out, k * R] with member j's B in rank band j, zeros
    elsewhere: what one unsplit adapter stack holding a fused projection's members would be."""
    num_slots, out_features, rank = lora_b.shape
    full = lora_b.new_zeros(num_slots, out_features, len(out_splits) * rank)
    start = 0
    for band, width in enumerate(out_splits):
        full[:, start : start + width, band * rank : (band + 1) * rank] = lora_b[:, start : start + width]
        start += width
    return full


def fused_step(out_splits: list[int], band_rank: int, b_layout: str, adapter_dtype: torch.dtype,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """A fused projection's step (y, x, lora_a [S, k * R, in], lora_b [S, out, R], row_slots, scales)."""
    in_features, num_slots = 72, 3
    lora_a, lora_b, scales = adapters(num_slots, len(out_splits) * band_rank, in_features, sum(out_splits), device)
    lora_b = lora_b[:, :, :band_rank].contiguous()
    lora_a, lora_b = lora_a.to(adapter_dtype), lora_b.to(adapter_dtype)
    if b_layout == "rank_major":
        lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    slots = row_slots("mixed", num_slots, device)
    x = torch.randn(slots.shape[0], in_features, device=device).to(dtype)
    y = torch.randn(slots.shape[0], sum(out_splits), device=device).to(dtype)
    return y, x, lora_a, lora_b, slots, scales


FUSED_CASES = [  # (out_splits, band_rank, b_layout, adapter dtype): q|k|v-like and gate|up-like
    ([64, 24, 24], 8, "rank_major", torch.float32),
    ([100, 100], 5, "peft", torch.bfloat16),
    ([40, 200, 8, 72], 3, "rank_major", torch.bfloat16),
]
