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
