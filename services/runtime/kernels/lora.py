"""Batched LoRA: each row of a step adds the low-rank update of its own adapter.

  y[t] += scales[s] * B_s (A_s x[t])        for every row t with s = row_slots[t] >= 0

Shapes: y [T, out], x [T, in], lora_a [S, R, in], lora_b [S, out, R], row_slots [T] int32 or
int64 (-1: the row has no adapter), scales [S] float32 (alpha / rank). An adapter of rank r < R
is padded with zeros to R, which adds nothing.

A fused projection (q|k|v, gate|up) takes its members' adapters in one call with
``out_splits``, the members' output widths (summing to out): lora_a is then [S, k * R, in], the
k members' A stacked, and lora_b [S, out, R], each member's B in its own output rows. Member j's
outputs get the update of ranks [j * R, (j + 1) * R) only, as a block-diagonal B would give,
without storing or reading its zeros; x is shrunk once for all members. The update is computed in fp32 whatever the base
weights are, from adapters stored in fp32 or (half the bytes to read per step) bf16, and added
to y with one rounding to y's dtype.

lora_b may be PEFT's layout (contiguous [S, out, R]) or the transposed view of a contiguous
[S, R, out] stack (``stack.transpose(1, 2)``), which is what the expand reads: the kernels take
that one in place, and on the CPU the other is transposed per call (see lora.cpp). A caller that
holds its adapters for many steps should stack B rank-major.

This is punica's BGMV/SGMV idea: one step serves rows of many adapters (and of none), and each
adapter's A and B are read once per step for all its rows, shrink (x A^T, [rows, R]) before
expand (. B^T, [rows, out]). ``lora_apply`` picks the kernel for the device: C++ on the CPU
(services/runtime/kernels/cpu/lora.cpp), the Triton kernels below on CUDA, and this reference
where neither fits (fp16 adapters on the CPU, a machine without a C++ compiler).
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

from services.runtime.kernels._common import FLOAT_DTYPES, check_devices, check_unit_last_stride

_log = structlog.get_logger("tokenmill.kernels")

MAX_RANK = 256
"""The largest (padded) rank the kernels take: Triton holds a block of rows' rank-wide h in registers."""


def check_lora_inputs(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    scales: torch.Tensor,
    out_splits: tuple[int, ...] | None = None,
) -> None:
    """Shapes, dtypes and devices (not the slot values: reading them would sync a GPU)."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x must be [T, in] and y [T, out] with the same T, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.dtype not in FLOAT_DTYPES or y.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x and y must be float16, bfloat16 or float32, got {x.dtype} and {y.dtype}")
    num_slots, rank, in_features = lora_a.shape if lora_a.dim() == 3 else (-1, -1, -1)
    if in_features != x.shape[1]:
        raise ValueError(f"lora_a must be [slots, rank, {x.shape[1]}], got {tuple(lora_a.shape)}")
    if out_splits is not None:
        if not out_splits or sum(out_splits) != y.shape[1] or min(out_splits) < 1 or rank % len(out_splits):
            raise ValueError(f"out_splits {tuple(out_splits)} must be positive widths summing to y's {y.shape[1]} "
                             f"columns, one per band of lora_a's {rank} ranks")
        rank //= len(out_splits)
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
    check_devices("y", y.device, x=x, lora_a=lora_a, lora_b=lora_b, row_slots=row_slots, scales=scales)


def slot_error(row_slots: torch.Tensor, bad: int, num_slots: int) -> ValueError:
    """The refusal of ``row_slots[bad]``, outside [-1, num_slots) (the checks' and the CPU kernel's)."""
    return ValueError(f"row_slots[{bad}] = {int(row_slots[bad])} must be -1 (no adapter) or a slot in [0, {num_slots})")


def check_slot_values(row_slots: torch.Tensor, num_slots: int) -> None:
    """Every entry of row_slots is -1 or a slot in [0, num_slots)."""
    if row_slots.numel() and (int(row_slots.min()) < -1 or int(row_slots.max()) >= num_slots):
        bad = int(((row_slots < -1) | (row_slots >= num_slots)).nonzero()[0, 0])
        raise slot_error(row_slots, bad, num_slots)


def lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    scales: torch.Tensor,
    out_splits: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """y [T, out] += scales[s] * (x @ A_s^T) @ B_s^T per row of slot s (in place; y is returned);
    with ``out_splits``, band by band (see the module docstring)."""
    check_lora_inputs(y, x, lora_a, lora_b, row_slots, scales, out_splits)
    check_slot_values(row_slots, lora_a.shape[0])
    splits = list(out_splits or [y.shape[1]])
    band_rank = lora_b.shape[2]
    for slot in row_slots.unique().tolist():
        if slot < 0:
            continue
        rows = (row_slots == slot).nonzero().squeeze(1)
        shrunk = x[rows].float() @ lora_a[slot].float().T  # [rows, k * R]
        bands = zip(shrunk.split(band_rank, dim=1), lora_b[slot].float().split(splits, dim=0))
        delta = torch.cat([h @ b.T for h, b in bands], dim=1)  # [rows, out]
        y[rows] = (y[rows].float() + scales[slot] * delta).to(y.dtype)
    return y


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    scales: torch.Tensor,
    out_splits: tuple[int, ...] | None = None,
    *,
    inputs_checked: bool = False,
) -> torch.Tensor:
    """``lora_reference``'s update with the fastest kernel for y's device; y is returned.

    ``inputs_checked=True`` skips ``check_lora_inputs`` for a caller that checked these shapes
    already. The CPU kernel refuses a slot outside [-1, S) with a ValueError; on CUDA the slot
    values are not read back (that would sync the device) and a row of such a slot gets no update.
    """
    if not inputs_checked:
        check_lora_inputs(y, x, lora_a, lora_b, row_slots, scales, out_splits)
    if y.device.type == "cuda":
        return lora_triton(y, x, lora_a, lora_b, row_slots, scales, out_splits)
    if y.device.type == "cpu" and _cpu_kernel_fits(y, x, lora_a, lora_b, row_slots, scales):
        ops = _cpu_ops()
        if ops is not None:
            bad = ops.lora_apply(y, x, lora_a, lora_b, row_slots, scales, list(out_splits or [y.shape[1]]))
            if bad >= 0:
                raise slot_error(row_slots, bad, lora_a.shape[0])
            return y
    return lora_reference(y, x, lora_a, lora_b, row_slots, scales, out_splits)


class LoraStack:
    """One projection's adapter stack (lora_a, lora_b, scales, out_splits), checked once.

    A step calls the kernel once per projection and layer (120 calls for SmolLM2's 30 layers),
    and at one row per adapter lora_apply's checks of the stack and its choice of kernel cost
    more than the CPU kernel itself (~7 us against ~5 us per call on the benchmark machine).
    Here they are done when the stack is made; ``apply`` checks only what changes per step (x, y,
    row_slots). The tensors are held, not copied: loading an adapter into a slot in place
    (``copy_``) needs no new stack.
    """

    __slots__ = ("lora_a", "lora_b", "scales", "out_splits", "_splits", "_cpu")

    def __init__(self, lora_a: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor,
                 out_splits: tuple[int, ...] | None = None):
        num_slots, rank, in_features = lora_a.shape if lora_a.dim() == 3 else (0, 0, 0)
        out_features = lora_b.shape[1] if lora_b.dim() == 3 else 0
        probe_y = torch.empty((0, out_features), dtype=torch.float32, device=lora_a.device)
        probe_x = torch.empty((0, in_features), dtype=torch.float32, device=lora_a.device)
        check_lora_inputs(probe_y, probe_x, lora_a, lora_b, torch.empty(0, dtype=torch.int32, device=lora_a.device),
                          scales, out_splits)
        self.lora_a, self.lora_b, self.scales, self.out_splits = lora_a, lora_b, scales, out_splits
        self._splits = list(out_splits or [out_features])
        self._cpu = (lora_a.device.type == "cpu" and lora_a.dtype in _CPU_ADAPTER_DTYPES and lora_a.is_contiguous()
                     and (lora_b.is_contiguous() or _rank_major(lora_b)) and scales.is_contiguous()
                     and rank <= MAX_RANK and _cpu_ops() is not None)

    def apply(self, y: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
        """``lora_apply(y, x, *stack, row_slots)``; y is returned."""
        a = self.lora_a
        if (self._cpu and x.dim() == 2 and y.dim() == 2 and x.shape[1] == a.shape[2] and y.shape[1] == self.lora_b.shape[1]
                and x.shape[0] == y.shape[0] == row_slots.shape[0] and row_slots.dim() == 1
                and x.dtype == y.dtype and x.dtype in FLOAT_DTYPES and row_slots.dtype in (torch.int32, torch.int64)
                and x.stride(1) == 1 and y.stride(1) == 1 and row_slots.is_contiguous()
                and x.device.type == y.device.type == row_slots.device.type == "cpu"):
            bad = _cpu_ops().lora_apply(y, x, a, self.lora_b, row_slots, self.scales, self._splits)
            if bad >= 0:
                raise slot_error(row_slots, bad, a.shape[0])
            return y
        return lora_apply(y, x, a, self.lora_b, row_slots, self.scales, self.out_splits)


_CPU_ADAPTER_DTYPES = (torch.float32, torch.bfloat16)


def _rank_major(lora_b: torch.Tensor) -> bool:
    """lora_b [S, out, R] is the transposed view of a [S, R, out] stack."""
    num_slots, out_features, rank = lora_b.shape
    return lora_b.stride(1) == 1 and lora_b.stride(2) == out_features and lora_b.stride(0) >= rank * out_features


def _cpu_kernel_fits(y, x, lora_a, lora_b, row_slots, scales) -> bool:
    return (lora_a.dtype in _CPU_ADAPTER_DTYPES and lora_a.is_contiguous()
            and (lora_b.is_contiguous() or _rank_major(lora_b))
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
_MAX_BANDS = 4  # members of a fused projection (out_splits) the expand kernel tells apart


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
    stride_y, stride_bs, stride_bo, stride_br, out_features, band_rank, end0, end1, end2,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # y[rows, n block] += scale_s * h[rows] B_s[n block]^T; B_s [out, band_rank] at its strides.
    # Output c of band j = (c >= end0) + (c >= end1) + (c >= end2) reads the ranks
    # [j * band_rank, (j + 1) * band_rank) of h: B's rows are placed there, zeros elsewhere.
    slot = tl.program_id(0)
    block = tl.program_id(1)
    if block * BLOCK_M >= tl.load(slot_count_ptr + slot):
        return
    positions, rows, row_mask = _slot_rows(sorted_rows_ptr, slot_start_ptr, slot_count_ptr, slot, block, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    h = tl.load(h_ptr + positions[:, None] * BLOCK_R + ranks[None, :], mask=row_mask[:, None], other=0.0)
    first = ((cols >= end0).to(tl.int32) + (cols >= end1).to(tl.int32) + (cols >= end2).to(tl.int32)) * band_rank
    in_band = (ranks[:, None] >= first[None, :]) & (ranks[:, None] < first[None, :] + band_rank)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + cols[None, :] * stride_bo
                + (ranks[:, None] - first[None, :]) * stride_br,
                mask=in_band & col_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
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
    out_splits: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The Triton kernels (CUDA, or the interpreter on the CPU); inputs as ``lora_apply``'s."""
    check_unit_last_stride(x=x, y=y)
    num_slots, rank, in_features = lora_a.shape
    if rank > MAX_RANK:
        raise ValueError(f"the adapters' rank must be <= {MAX_RANK}, got {rank}")
    num_rows, out_features = y.shape
    if num_rows == 0 or num_slots == 0 or rank == 0:
        return y
    splits = list(out_splits or [out_features])
    if len(splits) > _MAX_BANDS:
        raise ValueError(f"out_splits may name at most {_MAX_BANDS} members on the GPU, got {len(splits)}")
    ends = [sum(splits[: j + 1]) for j in range(len(splits) - 1)]
    ends += [out_features] * (_MAX_BANDS - 1 - len(ends))  # unused ends: no output reaches them
    lora_a, scales = lora_a.contiguous(), scales.contiguous()
    if not (lora_b.is_contiguous() or _rank_major(lora_b)):
        lora_b = lora_b.contiguous()
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
        shrunk, lora_b, y, scales, sorted_rows, starts, counts, y.stride(0), *lora_b.stride(), out_features,
        lora_b.shape[2], *ends,
        BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_N=_BLOCK_N, num_warps=4,
    )
    return y
