"""Batched LoRA: each row of a step adds the low-rank update of its own adapter.

  y[t] += scales[s] * B_s (A_s x[t])        for every row t with s = row_slots[t] >= 0

Shapes: y [T, out], x [T, in], lora_a [S, R, in], lora_b [S, out, R], row_slots [T] int32 or
int64 (-1: the row has no adapter), scales [S] float32 (alpha / rank). An adapter of rank r < R
is padded with zeros to R, which adds nothing. The update is computed in fp32 (adapters are
fp32 whatever the base weights are) and added to y with one rounding to y's dtype.

This is punica's BGMV/SGMV idea: one step serves rows of many adapters (and of none), and each
adapter's A and B are read once per step for all its rows, shrink (x A^T, [rows, R]) before
expand (. B^T, [rows, out]). ``lora_apply`` picks the kernel for the device: C++ on the CPU
(services/runtime/kernels/cpu/lora.cpp), the Triton kernels below on CUDA, and this reference
where neither fits (fp16 or bf16 adapters on the CPU, a machine without a C++ compiler).
``lora_reference`` is the PyTorch statement of the math every kernel is tested against.

The Triton kernels follow the same plan on the GPU: the rows are sorted by slot (on the device,
no sync), and a program takes a block of up to BLOCK_M rows of one slot, so its A and B tiles
are loaded once for the block and multiplied with tl.dot (SGMV; a decode step with one row per
adapter is the BGMV case of blocks of one row). A program whose block lies past its slot's rows
returns at once: the grid is sized for the worst case (every row on every slot) so that it
never depends on the slot counts, which live on the device.
"""

from __future__ import annotations

import functools

import structlog
import torch
import triton
import triton.language as tl

from services.runtime.kernels._common import FLOAT_DTYPES

_log = structlog.get_logger("tokenmill.kernels")

MAX_RANK = 256
"""The largest (padded) rank the kernels take: the C++ expand keeps a rank x 64 tile of B in L1."""


def check_lora_inputs(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Shapes, dtypes and devices (not the slot values: reading them would sync a GPU)."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x must be [T, in] and y [T, out] with the same T, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.dtype not in FLOAT_DTYPES or y.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x and y must be float16, bfloat16 or float32, got {x.dtype} and {y.dtype}")
    num_slots, rank, in_features = lora_a.shape if lora_a.dim() == 3 else (-1, -1, -1)
    if in_features != x.shape[1]:
        raise ValueError(f"lora_a must be [slots, rank, {x.shape[1]}], got {tuple(lora_a.shape)}")
    if tuple(lora_b.shape) != (num_slots, y.shape[1], rank):
        raise ValueError(f"lora_b must be [{num_slots}, {y.shape[1]}, {rank}] to match lora_a "
                         f"{tuple(lora_a.shape)} and y {tuple(y.shape)}, got {tuple(lora_b.shape)}")
    if lora_a.dtype != lora_b.dtype or lora_a.dtype not in FLOAT_DTYPES:
        raise ValueError(f"lora_a and lora_b must share one float dtype, got {lora_a.dtype} and {lora_b.dtype}")
    if row_slots.dtype not in (torch.int32, torch.int64) or tuple(row_slots.shape) != (x.shape[0],):
        raise ValueError(f"row_slots must be int32 or int64 [{x.shape[0]}], got {row_slots.dtype} "
                         f"{tuple(row_slots.shape)}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (num_slots,):
        raise ValueError(f"scales must be float32 [{num_slots}], got {scales.dtype} {tuple(scales.shape)}")
    for name, tensor in (("x", x), ("lora_a", lora_a), ("lora_b", lora_b), ("row_slots", row_slots),
                         ("scales", scales)):
        if tensor.device != y.device:
            raise ValueError(f"{name} must be on {y.device} with y, got {tensor.device}")


def check_slot_values(row_slots: torch.Tensor, num_slots: int) -> None:
    """Every entry of row_slots is -1 or a slot in [0, num_slots)."""
    if row_slots.numel() and (int(row_slots.min()) < -1 or int(row_slots.max()) >= num_slots):
        bad = int(((row_slots < -1) | (row_slots >= num_slots)).nonzero()[0, 0])
        raise ValueError(f"row_slots[{bad}] = {int(row_slots[bad])} must be -1 (no adapter) or a slot in "
                         f"[0, {num_slots})")


def lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    scales: torch.Tensor,
) -> torch.Tensor:
    """y [T, out] += scales[s] * (x @ A_s^T) @ B_s^T per row of slot s (in place; y is returned)."""
    check_lora_inputs(y, x, lora_a, lora_b, row_slots, scales)
    check_slot_values(row_slots, lora_a.shape[0])
    for slot in row_slots.unique().tolist():
        if slot < 0:
            continue
        rows = (row_slots == slot).nonzero().squeeze(1)
        shrunk = x[rows].float() @ lora_a[slot].float().T  # [rows, R]
        delta = shrunk @ lora_b[slot].float().T  # [rows, out]
        y[rows] = (y[rows].float() + scales[slot] * delta).to(y.dtype)
    return y


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    scales: torch.Tensor,
    *,
    inputs_checked: bool = False,
) -> torch.Tensor:
    """``lora_reference``'s update with the fastest kernel for y's device; y is returned.

    ``inputs_checked=True`` skips ``check_lora_inputs`` for a caller that checked these shapes
    already. The CPU kernel refuses a slot outside [-1, S) with a ValueError; on CUDA the slot
    values are not read back (that would sync the device) and a row of such a slot gets no update.
    """
    if not inputs_checked:
        check_lora_inputs(y, x, lora_a, lora_b, row_slots, scales)
    if y.device.type == "cuda":
        return lora_triton(y, x, lora_a, lora_b, row_slots, scales)
    if y.device.type == "cpu" and _cpu_kernel_fits(y, x, lora_a, lora_b, row_slots, scales):
        ops = _cpu_ops()
        if ops is not None:
            bad = ops.lora_apply(y, x, lora_a, lora_b, row_slots, scales)
            if bad >= 0:
                raise ValueError(f"row_slots[{bad}] = {int(row_slots[bad])} must be -1 (no adapter) or a slot in "
                                 f"[0, {lora_a.shape[0]})")
            return y
    return lora_reference(y, x, lora_a, lora_b, row_slots, scales)


def _cpu_kernel_fits(y, x, lora_a, lora_b, row_slots, scales) -> bool:
    return (lora_a.dtype == torch.float32 and lora_a.is_contiguous() and lora_b.is_contiguous()
            and x.dtype == y.dtype and x.stride(-1) == 1 and y.stride(-1) == 1 and row_slots.is_contiguous()
            and scales.is_contiguous() and lora_a.shape[1] <= MAX_RANK)


@functools.cache
def _cpu_ops() -> object | None:
    from services.runtime.kernels import cpu as cpu_kernels

    try:
        return cpu_kernels.load()
    except cpu_kernels.CpuKernelsUnavailable as exc:
        _log.warning("lora on the cpu runs the pytorch reference", reason=str(exc))
        return None


# ---------------------------------------------------------------------------- Triton (CUDA)

_BLOCK_M = 16  # rows of one slot per program (tl.dot's smallest tile)
_BLOCK_N = 64  # outputs per expand program
_BLOCK_K = 64  # input features per shrink iteration


@triton.jit
def _slot_rows(sorted_rows_ptr, slot_start_ptr, slot_count_ptr, slot, block, BLOCK_M: tl.constexpr):
    """The sorted positions and row ids of block ``block`` of ``slot``'s rows, and their mask."""
    count = tl.load(slot_count_ptr + slot)
    offsets = block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offsets < count
    positions = tl.load(slot_start_ptr + slot) + offsets
    rows = tl.load(sorted_rows_ptr + positions, mask=mask, other=0).to(tl.int64)
    return positions, rows, mask


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, h_ptr, sorted_rows_ptr, slot_start_ptr, slot_count_ptr,
    stride_x, in_features, rank,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # h [T, BLOCK_R] fp32 at sorted positions = x[rows] A_s^T; A_s [rank, in] is read once per block
    slot = tl.program_id(0)
    block = tl.program_id(1)
    if block * BLOCK_M >= tl.load(slot_count_ptr + slot):
        return
    positions, rows, row_mask = _slot_rows(sorted_rows_ptr, slot_start_ptr, slot_count_ptr, slot, block, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    a_base = a_ptr + slot.to(tl.int64) * rank * in_features
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :],
                    mask=row_mask[:, None] & (cols[None, :] < in_features), other=0.0).to(tl.float32)
        a = tl.load(a_base + ranks[None, :] * in_features + cols[:, None],
                    mask=(ranks[None, :] < rank) & (cols[:, None] < in_features), other=0.0).to(tl.float32)
        # adapters are fp32: a tf32 product would cost ~1e-3 of the update
        acc += tl.dot(x, a, input_precision="ieee")  # [BLOCK_M, BLOCK_R]
    tl.store(h_ptr + positions[:, None] * BLOCK_R + ranks[None, :], acc, mask=row_mask[:, None])


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, y_ptr, scales_ptr, sorted_rows_ptr, slot_start_ptr, slot_count_ptr,
    stride_y, out_features, rank,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # y[rows, n block] += scale_s * h[rows] B_s[n block]^T; B_s [out, rank]
    slot = tl.program_id(0)
    block = tl.program_id(1)
    if block * BLOCK_M >= tl.load(slot_count_ptr + slot):
        return
    positions, rows, row_mask = _slot_rows(sorted_rows_ptr, slot_start_ptr, slot_count_ptr, slot, block, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    h = tl.load(h_ptr + positions[:, None] * BLOCK_R + ranks[None, :], mask=row_mask[:, None], other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * out_features * rank + cols[None, :] * rank + ranks[:, None],
                mask=(ranks[:, None] < rank) & col_mask[None, :], other=0.0).to(tl.float32)
    delta = tl.dot(h, b, input_precision="ieee") * tl.load(scales_ptr + slot)  # [BLOCK_M, BLOCK_N]
    mask = row_mask[:, None] & col_mask[None, :]
    y_at = y_ptr + rows[:, None] * stride_y + cols[None, :]
    y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_at, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    scales: torch.Tensor,
) -> torch.Tensor:
    """The Triton kernels (CUDA, or the interpreter on the CPU); inputs as ``lora_apply``'s."""
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError(f"x and y need a unit last stride, got {x.stride()} and {y.stride()}")
    num_slots, rank, in_features = lora_a.shape
    if rank > MAX_RANK:
        raise ValueError(f"the adapters' rank must be <= {MAX_RANK}, got {rank}")
    num_rows, out_features = y.shape
    if num_rows == 0 or num_slots == 0 or rank == 0:
        return y
    lora_a, lora_b, scales = lora_a.contiguous(), lora_b.contiguous(), scales.contiguous()
    # Rows sorted by slot, the rows of slot -1 (and of any slot outside the stack) first and unused.
    slots = torch.where((row_slots >= 0) & (row_slots < num_slots), row_slots, -1).to(torch.int64)
    sorted_rows = torch.argsort(slots, stable=True).to(torch.int32)
    counts = torch.bincount(slots + 1, minlength=num_slots + 1)
    starts = (torch.cumsum(counts, 0) - counts)[1:].to(torch.int32).contiguous()  # [S]
    counts = counts[1:].to(torch.int32).contiguous()
    block_r = max(16, triton.next_power_of_2(rank))  # tl.dot needs K >= 16
    shrunk = torch.empty((num_rows, block_r), dtype=torch.float32, device=y.device)
    row_blocks = triton.cdiv(num_rows, _BLOCK_M)
    _lora_shrink_kernel[(num_slots, row_blocks)](
        x, lora_a, shrunk, sorted_rows, starts, counts, x.stride(0), in_features, rank,
        BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_K=_BLOCK_K, num_warps=4,
    )
    _lora_expand_kernel[(num_slots, row_blocks, triton.cdiv(out_features, _BLOCK_N))](
        shrunk, lora_b, y, scales, sorted_rows, starts, counts, y.stride(0), out_features, rank,
        BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_N=_BLOCK_N, num_warps=4,
    )
    return y
