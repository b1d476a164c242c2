"""Every resident adapter's weights, one LoraStack per projection of each layer, indexed by slot.

The model's projections are fused (q|k|v and gate|up, llama.py), so one stack serves a fused
projection with ``out_splits`` (services/runtime/kernels/lora.py): its A stacks the members' A
matrices, each in a band of ``max_rank`` rows, and its B holds each member's B in that member's
output columns, read by the kernel band by band (no block-diagonal zeros stored or read):

    lora_a [S, k * R, in], lora_b [S, R, out] (rank-major, the kernel reads it in place), scales [S]

An adapter of rank r < R and a member it does not target leave zeros, which add nothing. The
stacks are fp32 whatever the base model's weights (fp32, bf16, or quantized): the adapter's
numbers as trained.
"""

from __future__ import annotations

import torch

from services.runtime.kernels.lora import LoraStack
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
        """target module -> (fused projection, first output column, band index)."""
        sizes: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        for fused, members in FUSED_MODULES.items():
            column = 0
            for band, member in enumerate(members):
                self._placement[member] = (fused, column, band)
                column += shapes[member][0]
            sizes[fused] = (column, shapes[members[0]][1], tuple(shapes[m][0] for m in members))
        self.scales = torch.zeros(num_slots, device=device)
        self.layers: list[dict[str, LoraStack]] = []
        """Per layer, projection -> its stack (the tensors written in place by ``write``)."""
        for _ in range(config.num_layers):
            layer = {}
            for fused, (out_features, in_features, splits) in sizes.items():
                lora_a = torch.zeros(num_slots, len(splits) * max_rank, in_features, device=device)
                lora_b = torch.zeros(num_slots, max_rank, out_features, device=device)  # rank-major
                layer[fused] = LoraStack(lora_a, lora_b.transpose(1, 2), self.scales,
                                         splits if len(splits) > 1 else None)
            self.layers.append(layer)

    @property
    def nbytes(self) -> int:
        return sum(s.lora_a.nbytes + s.lora_b.nbytes for layer in self.layers for s in layer.values())

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` (its host weights) in ``slot``, replacing what was there."""
        assert adapter.weights is not None and adapter.rank <= self.max_rank
        for layer in self.layers:
            for stack in layer.values():
                stack.lora_a[slot].zero_()
                stack.lora_b[slot].zero_()
        r, big_r = adapter.rank, self.max_rank
        for (index, module), (lora_a, lora_b) in adapter.weights.items():
            fused, column, band = self._placement[module]
            stack = self.layers[index][fused]
            stack.lora_a[slot, band * big_r: band * big_r + r].copy_(lora_a)
            # lora_b is the [S, out, R] view of the rank-major store: B [out, r] lands in its columns
            stack.lora_b[slot, column: column + lora_b.shape[0], :r].copy_(lora_b)
        self.scales[slot] = adapter.scale
