"""Grammar masks on logits: packed bitmasks (one bit per token id, 32 to an int32) applied as -inf.

Bit t % 32 of word t // 32 says whether token t may be drawn (llguidance's layout). On a GPU
only the packed words cross from host to device (V / 8 bytes a row) and are unpacked there,
elementwise (a shift and an and per token: the same torch code on any device). On the CPU
NumPy's ``unpackbits`` does it in one pass (the int32 words read as little-endian bytes are
the bits in token order), and the logits take one in-place ``masked_fill_`` over the whole
batch: the torch unpacking costs a few element-wise passes, each an OpenMP region, which on
a busy machine cost milliseconds apiece (measured: python -m benchmarks structured).
"""

from __future__ import annotations

import numpy as np
import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool allowed (bits past the last word's ids are ignored)."""
    _check(bitmask, vocab_size)
    words = bitmask.shape[1]
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]: arithmetic shift, the & keeps bit 0
    return bits.view(bitmask.shape[0], words * 32)[:, :vocab_size].bool()


def unpack_token_bitmask_host(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """``unpack_token_bitmask`` on the host: [R, W] int32 -> [R, vocab_size] bool."""
    words = np.ascontiguousarray(bitmask, dtype="<i4")
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return bits.view(bool)


def token_allowed(bitmask: np.ndarray, row: int, token_id: int) -> bool:
    """Whether bit ``token_id`` of ``bitmask[row]`` ([R, W] int32, host) is set: one token's
    answer, where ``unpack_token_bitmask_host`` unpacks the whole vocabulary."""
    return bool((int(bitmask[row, token_id >> 5]) >> (token_id & 31)) & 1)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set logits[rows[i], t] = -inf where bit t of bitmask[i] is 0; rows None = every row in order.

    logits: [B, V] float; bitmask: [R, W] int32 on logits' device; rows: [R] int64.
    """
    vocab_size = logits.shape[1]
    _check(bitmask, vocab_size)
    if logits.device.type == "cpu":
        allowed = unpack_token_bitmask_host(bitmask.numpy(), vocab_size)
        if rows is not None:
            full = np.ones(tuple(logits.shape), dtype=bool)
            full[rows.numpy()] = allowed
            allowed = full
        logits.masked_fill_(torch.from_numpy(~allowed), float("-inf"))
        return
    allowed = unpack_token_bitmask(bitmask, vocab_size)
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def _check(bitmask: torch.Tensor, vocab_size: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} with {bitmask.dim()} dims")
    words = bitmask.shape[1]
    if words * 32 < vocab_size:
        raise ValueError(f"bitmask has {words} words ({words * 32} ids) for a vocabulary of {vocab_size}")
