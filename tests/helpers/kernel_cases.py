"""Helpers of the kernel tests: parameter grids, paged batches with poisoned pools, tolerances."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

FULL_GRID = os.environ.get("TOKENMILL_FULL_KERNEL_GRID") == "1"
"""Full cross products (GPU); otherwise covering subsets (interpreter), see ``grid``."""

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP32_TOLERANCE = 1e-5
LOW_PRECISION_FACTOR = 2.0
"""A 16-bit kernel may be at most this many times further from the fp32 reference than the
reference itself computed in that dtype (flash-attention's criterion), plus FP32_TOLERANCE."""


def grid(strength: int = 2, **axes: list) -> list[dict]:
    """The cross product of ``axes``, or (without FULL_GRID) a greedy subset of it in which every
    combination of values of any ``strength`` axes still occurs at least once (strength 2:
    every pair; strength >= len(axes): the full product)."""
    names = list(axes)
    every_case = list(itertools.product(*axes.values()))
    if FULL_GRID or strength >= len(names):
        return [dict(zip(names, case)) for case in every_case]

    def combinations(case: tuple) -> set:
        return {tuple((i, case[i]) for i in chosen) for chosen in itertools.combinations(range(len(case)), strength)}

    uncovered = set().union(*(combinations(case) for case in every_case))
    chosen = []
    while uncovered:
        best = max(every_case, key=lambda case: len(combinations(case) & uncovered))
        chosen.append(dict(zip(names, best)))
        uncovered -= combinations(best)
    return chosen


def case_id(case: dict) -> str:
    return "-".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in case.items())


@dataclass
class PagedBatch:
    k_cache: torch.Tensor  # [NB, BS, KH, D]; slots no sequence owns hold NaN
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, W] int32, shuffled ids, padded with 0
    context_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    query_lens: list[int]
    slots: torch.Tensor  # [sum(context_lens)] int64, every owned slot in sequence order
    used_blocks: torch.Tensor  # [n] int64 the block ids the tables use

    @property
    def max_context_len(self) -> int:
        return int(self.context_lens.max())

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    def new_token_slots(self) -> torch.Tensor:
        """Slots of each sequence's last query_len tokens, in query order: [T] int64."""
        parts, start = [], 0
        for context_len, query_len in zip(self.context_lens.tolist(), self.query_lens):
            parts.append(self.slots[start + context_len - query_len : start + context_len])
            start += context_len
        return torch.cat(parts)


def build_paged_batch(
    context_lens: list[int],
    query_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int | None = None,
    first_block_id: int = 0,
    poison: float = float("nan"),
) -> PagedBatch:
    """Random K/V (never zero) in the slots of each sequence's context; ``poison`` (NaN) in every
    other slot of the blocks the batch touches, and in the pool's first block, so a kernel that
    reads a slot it does not own (or a wrapped-around offset) produces NaN. Block ids are a
    random permutation drawn from [first_block_id, num_blocks)."""
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    needed = sum(blocks_per_seq)
    num_blocks = num_blocks or first_block_id + needed + 5
    if first_block_id + needed > num_blocks:
        raise ValueError(f"{needed} blocks from id {first_block_id} do not fit a pool of {num_blocks}")
    span = min(num_blocks - first_block_id, 4 * needed + 8)
    ids = first_block_id + torch.randperm(span)[:needed]
    width = max(blocks_per_seq)
    block_tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    slots, start = [], 0
    for seq, (context_len, n) in enumerate(zip(context_lens, blocks_per_seq)):
        table = ids[start : start + n]
        block_tables[seq, :n] = table.int()
        token = torch.arange(context_len)
        slots.append(table[token // block_size] * block_size + token % block_size)
        start += n
    slots = torch.cat(slots).to(device)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=device)  # big pools stay mostly untouched
    v_cache = torch.empty(shape, dtype=dtype, device=device)
    poisoned = torch.cat([torch.tensor([0]), ids]).to(device)
    for cache in (k_cache, v_cache):
        cache[poisoned] = poison
        cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            len(slots), num_kv_heads, head_dim, device=device).to(dtype)
    query_start_loc = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device)
    return PagedBatch(
        k_cache, v_cache, block_tables.to(device), torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc, list(query_lens), slots, ids.to(device),
    )


def assert_matches_reference(out: torch.Tensor, reference: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> None:
    """Compares ``out`` with ``reference(*inputs)`` evaluated on fp32 copies of the float inputs.
    fp32: within FP32_TOLERANCE. fp16/bf16: no further from the fp32 answer than
    LOW_PRECISION_FACTOR times the reference's own error when run in that dtype."""
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements are NaN (unwritten or poisoned reads)"
    upcast = [x.float() if x.is_floating_point() else x for x in inputs]
    expected = reference(*upcast)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=FP32_TOLERANCE, rtol=FP32_TOLERANCE)
        return
    kernel_error = (out.float() - expected).abs().max().item()
    reference_error = (reference(*inputs).float() - expected).abs().max().item()
    limit = LOW_PRECISION_FACTOR * reference_error + FP32_TOLERANCE
    assert kernel_error <= limit, (f"{out.dtype} kernel max error {kernel_error:.3g} exceeds {limit:.3g} "
                                   f"({LOW_PRECISION_FACTOR}x the reference's own {reference_error:.3g})")


def poisoned_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.full_like(tensor, float("nan"))
