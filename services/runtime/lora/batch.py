"""One step's adapters: the slot each flattened row reads (-1: the base model alone)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.runtime.lora.stacks import LoraStacks


@dataclass(frozen=True, slots=True)
class LoraBatch:
    stacks: LoraStacks
    row_slots: torch.Tensor
    """[T] int32, one entry per token of the flattened batch."""

    @classmethod
    def for_rows(cls, stacks: LoraStacks, slots: list[int], rows, device: torch.device) -> LoraBatch:
        """Each row's slot repeated over its tokens: ``rows`` are (sequence, tokens scheduled)."""
        per_token = [slot for slot, (_, n) in zip(slots, rows) for _ in range(n)]
        return cls(stacks, torch.tensor(per_token, dtype=torch.int32, device=device))

    def apply(self, layer: int, projection: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """y [T, out] += each row's scale * B (A x) of ``projection`` in ``layer``: computed in
        fp32 from the fp32 stacks and rounded once into y (services/runtime/kernels/lora.py)."""
        self.stacks.layers[layer][projection].apply(y, x, self.row_slots)
