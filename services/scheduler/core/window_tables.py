"""The sliding-window rules over a request's block table (services/common/kv_groups.py).

A model mixing window and full-attention layers has several KV groups, and a request's block
table interleaves them (entry ``i * num_groups + k`` is group ``k``'s block for the ``i``-th
``block_size`` tokens). Once a window group's block lies wholly before the window of the
request's next query, the request gives it back; its entry stays in the table (the executor
never reads it again: every backend attends within the window) but the block is free, and
keeps its prefix hash until evicted. A prefix hit then needs the full groups' blocks of the
whole prefix but the window groups' blocks of its last window only; the entries before that
are ``PLACEHOLDER``, held by no one and never read. Per request, ``start`` is the first block
whose window-group entries it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.kv_groups import first_needed_block
from services.scheduler.core.free_block_queue import KVBlock

PLACEHOLDER = 0
"""A window group's table entry the request does not hold (before its window since a prefix
hit): any valid id, never read."""


class WindowTables:
    def __init__(self, block_size: int, group_windows: Sequence[int]) -> None:
        self.block_size = block_size
        self.group_windows = tuple(group_windows)
        """Per KV group, its sliding window in tokens (0: full attention)."""
        self.num_groups = len(self.group_windows)
        self.full_groups = [k for k, w in enumerate(self.group_windows) if not w]
        self._start: dict[str, int] = {}
        """Per request: its first block whose window-group entries it holds (absent: 0)."""

    def first_needed(self, num_computed_tokens: int) -> int:
        """The first block whose window-group entries a request with this many computed tokens
        still reads (one bound for every window group: the widest window's)."""
        return min((first_needed_block(num_computed_tokens, w, self.block_size) for w in self.group_windows if w),
                   default=0)

    def holds(self, request_id: str, index: int) -> list[int]:
        """The groups whose entries of block ``index`` the request holds."""
        start = self._start.get(request_id, 0)
        return [k for k, w in enumerate(self.group_windows) if not w or index >= start]

    def held_ids(self, request_id: str, table: Sequence[int]) -> list[int]:
        """The blocks of ``table`` the request holds (without the window entries it gave back)."""
        return [table[index * self.num_groups + k] for index in range(len(table) // self.num_groups)
                for k in self.holds(request_id, index)]

    def hit_table(self, hits: list[list[KVBlock | None]]) -> list[int]:
        """The table of the longest prefix of ``hits`` (per block, per group: the cached block or
        None) whose window groups hold every block their last window reads."""
        num_hit = len(hits)
        while num_hit > 0 and not all(hits[index][k] is not None
                                      for index in range(self.first_needed(num_hit * self.block_size), num_hit)
                                      for k, window in enumerate(self.group_windows) if window):
            num_hit -= 1
        first = self.first_needed(num_hit * self.block_size)
        return [hits[index][k].block_id if not w or index >= first else PLACEHOLDER
                for index in range(num_hit) for k, w in enumerate(self.group_windows)]

    def claimed(self, hit_table: Sequence[int]) -> tuple[list[int], int]:
        """(the blocks of a prefix hit's table the request holds, its window start)."""
        n = self.num_groups
        start = self.first_needed(len(hit_table) // n * self.block_size)
        return [block_id for entry, block_id in enumerate(hit_table)
                if not self.group_windows[entry % n] or entry // n >= start], start

    def set_start(self, request_id: str, start: int) -> None:
        self._start[request_id] = start

    def passed(self, request_id: str, table: Sequence[int], num_computed_tokens: int) -> list[int]:
        """The window entries its next query no longer reads, oldest first, given up now."""
        n = self.num_groups
        first = min(self.first_needed(num_computed_tokens), len(table) // n)
        start = self._start.get(request_id, 0)
        if first <= start:
            return []
        self._start[request_id] = first
        return [table[index * n + k] for index in range(start, first) for k, w in enumerate(self.group_windows) if w]

    def forget(self, request_id: str) -> None:
        self._start.pop(request_id, None)
