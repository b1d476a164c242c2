"""The blocks of one executor's KV pool: who holds each, and which are free in eviction order.

Pure accounting (the memory is the executor's). A free block may still cache a prefix (its
hash, see prefix_cache.py): it stays reusable until the pool takes it for new K/V, which
evicts that prefix first (least recently freed first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from services.scheduler.core.free_block_queue import FreeBlockQueue, KVBlock


class BlockPool:
    def __init__(self, num_blocks: int, evict: Callable[[KVBlock], None]) -> None:
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self._free = FreeBlockQueue(self.blocks)
        self._evict = evict
        """Called with a cached block the pool takes for new K/V: its prefix is no longer cached."""

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return (len(self.blocks) - len(self._free)) / len(self.blocks)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (next handed out first). O(n): tests, debugging."""
        return self._free.block_ids()

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        """How many of these (cached) blocks nobody holds: claiming them takes them from the free pool."""
        return sum(1 for block_id in block_ids if self.blocks[block_id].ref_count == 0)

    def claim(self, block_ids: Iterable[int]) -> None:
        """One more hold on each cached block; a free one leaves the free queue with its K/V."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._free.remove(block)
            block.ref_count += 1

    def take(self, count: int) -> list[int]:
        """``count`` free blocks, held once each (the caller checked there are enough)."""
        taken = []
        for _ in range(count):
            block = self._free.popleft()
            if block.block_hash is not None:
                self._evict(block)
                block.block_hash = None
            block.ref_count = 1
            taken.append(block.block_id)
        return taken

    def release(self, block_ids: list[int]) -> None:
        """Drop one hold on each block, last first (the tail of a sequence is its least
        shareable part, so it is evicted before the prefix); those nobody holds become free."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free.append(block)
