"""KV-cache slot accounting: how much of the memory held by running requests holds tokens.

Paged attention allocates whole blocks, so a request's last block is partly empty until its
tokens fill it. The waste is, over the running requests,

    allocated = sum(len(block_ids) * block_size)
    used      = sum(min(allocated of the request, its known tokens))
    waste     = (allocated - used) / allocated

"Known tokens" (prompt + generated) rather than computed ones, so a reading taken while a
step is in flight (blocks already allocated for the tokens being computed) and one taken
after it agree. A block shared through the prefix cache counts once per request holding it:
the figure is what each request's block table wastes, not the pool's layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.request.request import Request


@dataclass(frozen=True, slots=True)
class KVSlotUsage:
    allocated_slots: int
    used_slots: int

    @property
    def wasted_slots(self) -> int:
        return self.allocated_slots - self.used_slots

    @property
    def waste_fraction(self) -> float:
        """Wasted over allocated slots, in [0, 1); 0 when nothing is allocated."""
        return self.wasted_slots / self.allocated_slots if self.allocated_slots else 0.0


def kv_slot_usage(running: Iterable[Request], block_size: int, num_kv_groups: int = 1) -> KVSlotUsage:
    """``num_kv_groups``: block tables interleave that many groups' blocks; a row of them counts
    as one block (services/common/kv_groups.py)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    allocated = used = 0
    for request in tuple(running):  # a snapshot: another thread may be reading while the loop mutates
        slots = len(request.block_ids) // num_kv_groups * block_size
        allocated += slots
        used += min(slots, request.num_tokens)
    return KVSlotUsage(allocated, used)
