"""Reusing cached prefixes: the cached blocks a request starts from, its computed blocks cached
for later requests, and how often a lookup hits.

The index (which block caches which prefix, each request's hash chain) is prefix_cache.py's;
this is the rule over a request's block table. Only full blocks of confirmed tokens are
cached; a hit never covers the last token (the step must produce logits to sample from); a
request that needs prompt logprobs computes its whole prompt. Window groups need only their
last window's blocks (window_tables.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.scheduler.core.block_pool import BlockPool
from services.scheduler.core.prefix_cache import PrefixCache
from services.scheduler.core.window_tables import WindowTables

if TYPE_CHECKING:
    from services.scheduler.request.request import Request


class PrefixReuse:
    def __init__(self, enabled: bool, windows: WindowTables, index: PrefixCache, pool: BlockPool) -> None:
        self.enabled = enabled
        self._windows = windows
        self._num_groups, self._block_size = windows.num_groups, windows.block_size  # read every step
        self.index = index
        """Which block caches which prefix; its probe (cached_prefix_tokens) is 0 while disabled,
        as nothing is ever cached."""
        self._pool = pool
        self.queries = 0
        """Tokens looked up in the prefix cache (request length at each first allocation)."""
        self.hits = 0
        """Tokens of those lookups served from the cache."""

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request, in full blocks: (block ids, tokens covered); none
        for a request that holds blocks or needs prompt logprobs (vLLM skips the cache for them
        too). Pure lookup: nothing is claimed until BlockManager.allocate_slots."""
        if not self.enabled or request.block_ids or request.needs_prompt_logprobs:
            return [], 0
        windows = self._windows
        max_hit_blocks = (request.num_tokens - 1) // windows.block_size
        hits = self.index.cached_rows(request, max_hit_blocks, windows.num_groups, windows.full_groups)
        table = windows.hit_table(hits)
        return table, len(table) // windows.num_groups * windows.block_size

    def claim(self, request: Request, hit_block_ids: Sequence[int], num_new_blocks: int) -> bool:
        """Hold a prefix hit's blocks (a free cached one leaves the free pool) if ``num_new_blocks``
        stay free besides; False, changing nothing, if not. A request's first claim is a lookup:
        counted, and where its window groups' entries start (see window_tables.py)."""
        claimed, window_start = self._windows.claimed(hit_block_ids)
        if num_new_blocks + self._pool.num_free_among(claimed) > self._pool.num_free:
            return False
        self._pool.claim(claimed)
        if not request.block_ids:
            if window_start:
                self._windows.set_start(request.request_id, window_start)
            if self.enabled:
                self.queries += request.num_tokens
                self.hits += len(hit_block_ids) // self._num_groups * self._block_size
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """After request.num_computed_tokens advanced: cache its full blocks of confirmed tokens
        (a block a step in flight still writes, or holding a token not sampled yet, never is).
        Where two requests computed one prefix at once, the first block stays its cached copy."""
        if not self.enabled:
            return
        n, size = self._num_groups, self._block_size
        num_full = min(request.num_computed_tokens // size, len(request.block_ids) // n)
        start = self.index.registered.get(request.request_id, 0)
        if num_full <= start:
            return
        self.index.register(request, num_full, (
            (index, k, self._pool.blocks[request.block_ids[index * n + k]])
            for index in range(start, num_full) for k in self._windows.holds(request.request_id, index)))
