"""KV-cache block bookkeeping records and the queue of free blocks.

The scheduler only does accounting: a KVBlock here is a number plus metadata; the memory it
names lives in the executor.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVBlock:
    """Metadata of one physical KV-cache block.

    ``prev_free`` / ``next_free`` are the links of the FreeBlockQueue (intrusive list): they are
    set exactly while the block sits in the queue.
    """

    __slots__ = ("block_id", "ref_count", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        """Requests whose block table holds this block."""
        self.block_hash: bytes | None = None
        """Set while the block is in the prefix cache (full, computed, registered)."""
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    @property
    def is_free(self) -> bool:
        return self.prev_free is not None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVBlock({self.block_id}, ref={self.ref_count}, {cached})"


class FreeBlockQueue:
    """Free blocks in eviction order: the head is handed out (and evicted) next.

    Implemented as a doubly linked list threaded through the blocks themselves, with two
    sentinel nodes, instead of a deque. The reason is prefix caching: a free block may still
    hold the K/V of a cached prefix, and when a new request hits that prefix the block must
    leave the queue from wherever it sits, usually the middle. A deque (or list) removes from
    the middle in O(n); unlinking through the block's own pointers is O(1) and allocates
    nothing. Freed blocks are appended at the tail and allocation pops the head, so the order
    is least-recently-freed first (LRU over cached prefixes).
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        # Sentinels: _head.next_free is the first free block, _tail.prev_free the last.
        self._head, self._tail = KVBlock(-1), KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._length = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._length

    def popleft(self) -> KVBlock:
        """Remove and return the head (the block to hand out / evict next)."""
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("pop from an empty FreeBlockQueue")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        """Unlink a block from anywhere in the queue in O(1) (prefix-cache hit on a free block)."""
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free, next_block.prev_free = next_block, prev_block
        block.prev_free = block.next_free = None
        self._length -= 1

    def append(self, block: KVBlock) -> None:
        """Put a block at the tail (evicted last)."""
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free, block.next_free = last, self._tail
        self._tail.prev_free = block
        self._length += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head to tail. O(n): for tests and debugging."""
        ids = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids
