"""Grammar masks on logits: packed bitmasks (one bit per token id, 32 to an int32) unpacked on
the logits' device and applied as -inf.

Bit t % 32 of word t // 32 says whether token t may be drawn (llguidance's layout). The
unpacking is elementwise (a shift and an and per token), so the same torch code runs on CPU
and GPU with no kernel of its own; only the packed words cross from host to device (V / 8
bytes a row).
"""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool allowed (bits past the last word's ids are ignored)."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} with {bitmask.dim()} dims")
    words = bitmask.shape[1]
    if words * 32 < vocab_size:
        raise ValueError(f"bitmask has {words} words ({words * 32} ids) for a vocabulary of {vocab_size}")
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]: arithmetic shift, the & keeps bit 0
    return bits.view(bitmask.shape[0], words * 32)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set logits[rows[i], t] = -inf where bit t of bitmask[i] is 0; rows None = every row in order.

    logits: [B, V] float; bitmask: [R, W] int32 on logits' device; rows: [R] int64.
    """
    allowed = unpack_token_bitmask(bitmask, logits.shape[1])
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
