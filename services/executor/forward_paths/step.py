"""One forward's input, as every forward path sees it: the scheduled rows, and their tensors.

The tensors are packed on first use (two host-to-device copies, services/runtime/step_inputs.py)
and then shared: a path that reads the rows alone (the decode graphs fill buffers of their own)
never packs them, and a step no path before eager takes packs them once.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from services.runtime.lora.batch import LoraBatch
from services.runtime.model.attention.base import AttentionMetadata
from services.runtime.step_inputs import pack_rows

if TYPE_CHECKING:
    from services.executor.sequences import SequenceState


@dataclass(frozen=True, slots=True)
class PackedStep:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata


class ForwardStep:
    """Rows of (sequence, tokens scheduled): the next ``n`` tokens after its computed ones."""

    __slots__ = ("rows", "query_starts", "lora", "_block_size", "_device", "_packed", "_num_kv_groups")

    def __init__(self, rows: list[tuple[SequenceState, int]], block_size: int, device: torch.device,
                 num_kv_groups: int = 1, lora: LoraBatch | None = None) -> None:
        self.rows = rows
        self.lora = lora
        """Each token's LoRA adapter slot (None: the base model for every row)."""
        self.query_starts = [0, *accumulate(n for _, n in rows)]
        """Where each row's tokens start in the flattened batch, and the total: [B + 1]."""
        self._block_size = block_size
        self._device = device
        self._packed: PackedStep | None = None
        self._num_kv_groups = num_kv_groups
        """Block tables interleave this many KV groups (services/common/kv_groups.py)."""

    @property
    def is_decode_only(self) -> bool:
        """One new token per sequence."""
        return self.query_starts[-1] == len(self.rows)

    @property
    def max_blocks(self) -> int:
        """The widest block table of the step."""
        return max(len(state.block_ids) for state, _ in self.rows)

    def decode_rows(self) -> list[tuple[int, int, list[int]]]:
        """(token id, position, block ids) per row of a decode-only step."""
        return [(s.token_ids[s.num_computed_tokens], s.num_computed_tokens, s.block_ids) for s, _ in self.rows]

    @property
    def packed(self) -> PackedStep:
        if self._packed is None:
            rows = [(s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n], s.num_computed_tokens, s.block_ids)
                    for s, n in self.rows]
            ids, positions, meta, _ = pack_rows(rows, self._block_size, self._device, self._num_kv_groups)
            self._packed = PackedStep(ids, positions, meta)
        return self._packed
