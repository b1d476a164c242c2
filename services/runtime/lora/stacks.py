"""Every resident adapter's weights, one stack per projection of each layer, indexed by slot.

The model's projections are fused (q|k|v and gate|up, llama.py), so one stack serves a fused
projection: its A stacks the members' A matrices (each in a band of ``max_rank`` rows) and its B
places each member's B in that member's output rows and band columns, zeros elsewhere. One
batched low-rank product per projection then adds every row's own adapter:

    lora_a [S, k * R, in], lora_b [S, out, k * R], scales [S]   (k members, R = max_rank)

An adapter of rank r < R and a member it does not target leave zeros, which add nothing. The
stacks are fp32 whatever the base model's weights (fp32, bf16, or quantized): the adapter's
numbers as trained.
"""

from __future__ import annotations

import torch

from services.runtime.lora.adapter import LoraAdapter, module_shapes
from services.runtime.model.config import ModelConfig

FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""The model layer's projections (llama.py's attribute names) and the target modules each fuses."""


class LoraStacks:
    def __init__(self, config: ModelConfig, num_slots: int, max_rank: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        shapes = module_shapes(config)
        self._placement: dict[str, tuple[str, int, int]] = {}
        """target module -> (fused projection, first output row, band index)."""
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        """Per layer, projection -> (lora_a [S, k*R, in], lora_b [S, out, k*R])."""
        sizes = {}
        for fused, members in FUSED_MODULES.items():
            row = 0
            for band, member in enumerate(members):
                self._placement[member] = (fused, row, band)
                row += shapes[member][0]
            sizes[fused] = (row, shapes[members[0]][1], len(members) * max_rank)
        for _ in range(config.num_layers):
            self.layers.append({
                fused: (torch.zeros(num_slots, width, in_features, device=device),
                        torch.zeros(num_slots, out_features, width, device=device))
                for fused, (out_features, in_features, width) in sizes.items()})
        self.scales = torch.zeros(num_slots, device=device)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` (its host weights) in ``slot``, replacing what was there."""
        assert adapter.weights is not None and adapter.rank <= self.max_rank
        for layer in self.layers:
            for a, b in layer.values():
                a[slot].zero_()
                b[slot].zero_()
        r, big_r = adapter.rank, self.max_rank
        for (index, module), (lora_a, lora_b) in adapter.weights.items():
            fused, row, band = self._placement[module]
            a, b = self.layers[index][fused]
            a[slot, band * big_r: band * big_r + r].copy_(lora_a)
            b[slot, row: row + lora_b.shape[0], band * big_r: band * big_r + r].copy_(lora_b)
        self.scales[slot] = adapter.scale
