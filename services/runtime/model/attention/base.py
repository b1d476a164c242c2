"""The attention backend interface and the per-step metadata every backend reads.

The model runner builds one ``AttentionMetadata`` per step and passes it explicitly down
the model (no module-global "current context"). A backend does two things per layer:
write the step's new K/V into the paged pool, then attend each new query token over its
sequence's cached context (prefix + the new tokens themselves, causally).

Shapes (T = new tokens in the step, B = sequences, H = query heads, KH = kv heads):
  q:            [T, H, D]
  k, v (new):   [T, KH, D]
  k/v cache:    [num_blocks, block_size, KH, D]   one pool per layer
  slot_mapping: [T]     int64   flat slot (block_id * block_size + offset) of each new token
  block_tables: [B, max_blocks_per_seq] int32, padded with 0 past each sequence's blocks
  context_lens: [B]     int32   tokens in the cache for each sequence after this step's write
  query_start_loc: [B+1] int32  cumulative new-token counts (cu_seqlens of the queries)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    query_lens_cpu: list[int]
    """Host copies, so backends can branch without a device sync."""
    context_lens_cpu: list[int]
    max_query_len: int
    max_context_len: int
    block_size: int
    groups: tuple[AttentionMetadata, ...] = ()
    """With KV groups (services/common/kv_groups.py): each group's metadata (its own slots and
    block tables, the rest shared), group 0 being this one; empty for one group."""

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV group ``group`` reads."""
        return self.groups[group] if self.groups else self

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store the new tokens' K/V at ``meta.slot_mapping``."""
        ...

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of each new query over its sequence's cached context. Returns [T, H, D].
        ``window``: a sliding-window layer's keys per query (the query's own and the ``window - 1``
        before it); None attends over the whole context.

        The torch, cpu and triton backends also take ``softcap=c`` (Gemma 2: scores
        ``c * tanh(s / c)`` before the mask and softmax); a model that needs it refuses any other
        backend by name (gemma2.SOFTCAP_BACKENDS)."""
        ...
