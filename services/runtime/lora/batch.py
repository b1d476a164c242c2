"""One step's adapters: the slot each flattened row reads (-1: the base model alone)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.runtime.lora.stacks import LoraStacks

try:
    from services.runtime.kernels.lora import lora_apply
except ImportError:  # before the batched kernels land: their PyTorch reference
    from services.runtime.lora.reference import lora_apply


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
        """y [T, out] += each row's scale * (x [T, in] @ A^T) @ B^T of ``projection`` in ``layer``."""
        lora_a, lora_b = self.stacks.layers[layer][projection]
        if y.dtype == torch.float32 and x.dtype == torch.float32:
            lora_apply(y, x, lora_a, lora_b, self.row_slots, self.stacks.scales)
            return
        # A half-precision model: the adapter's product in fp32, then rounded once into y.
        out = y.float()
        lora_apply(out, x.float(), lora_a, lora_b, self.row_slots, self.stacks.scales)
        y.copy_(out)
