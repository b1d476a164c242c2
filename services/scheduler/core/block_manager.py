"""Which KV-cache blocks each request uses, with prefix caching over full blocks.

The scheduler owns block accounting, the executor owns the memory: this class decides block
ids; the executor writes K/V where the plan says.

Its collaborators hold the state, and answer for it: ``pool`` (block_pool.py: ref counts, the
free queue, usage), ``prefixes`` (prefix_reuse.py over prefix_cache.py's index: lookups,
registering computed blocks, hit counters) and ``windows`` (window_tables.py). A request whose
prompt starts with full blocks another computed reuses them (ref counts > 1) instead of
recomputing. When a request finishes, its blocks go back to the free queue but keep their
hash: they stay reusable until the pool needs them for something else (eviction, least
recently freed first).

Block 0 is an ordinary block. No "null" block is reserved: padding entries of a block table
are never read (context lengths bound every gather) and padded slots use slot id -1, so the
executor needs no dummy block.

Sliding windows: the rules over a table whose KV groups include window groups (entries given
back once the window passes them, placeholders before a prefix hit's last window) are
window_tables.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.scheduler.core.block_pool import BlockPool
from services.scheduler.core.prefix_cache import PrefixCache, hash_block_tokens, scope_root_hash
from services.scheduler.core.prefix_reuse import PrefixReuse
from services.scheduler.core.window_tables import PLACEHOLDER, WindowTables

if TYPE_CHECKING:
    from services.scheduler.request.request import Request

__all__ = ["PLACEHOLDER", "BlockManager", "hash_block_tokens", "scope_root_hash"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates blocks to requests, shares cached prefix blocks, evicts LRU cached blocks.
    Every request's block table is ``request.block_ids``; this class is the only writer."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: Sequence[int] = (0,)) -> None:
        _check(num_blocks, block_size, group_windows)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = WindowTables(block_size, group_windows)
        index = PrefixCache(block_size)
        self.pool = BlockPool(num_blocks, index.evict)
        self.prefixes = PrefixReuse(enable_prefix_caching, self.windows, index, self.pool)

    def computed(self, request: Request) -> None:
        """After request.num_computed_tokens advanced: cache its full blocks, then give back the
        window groups' blocks that its next query's window has passed (still cached, they stay
        reusable by a later prefix until evicted). Queries of steps in flight come later still,
        so they read none of them; nothing writes them again."""
        self.prefixes.cache_full_blocks(request)
        if any(self.windows.group_windows):
            passed = self.windows.passed(request.request_id, request.block_ids, request.num_computed_tokens)
            self.pool.release(passed[::-1])  # release() appends in reverse: the oldest is evicted first

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = ()
                       ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the request's planned ones
        (computed, plus those the steps in flight compute: ``request.num_planned_tokens``).

        ``computed_block_ids``: a prefix hit (prefixes.get_computed_blocks), claimed now; only
        for a request that holds no blocks yet, before its num_computed_tokens is set to the hit.
        Returns the new block ids (appended to request.block_ids after the hit's), or None,
        changing nothing, when there are not enough free blocks.
        """
        _check_hit(request, computed_block_ids)
        n = self.windows.num_groups
        num_hit_blocks = len(computed_block_ids) // n
        num_required = _cdiv(request.num_planned_tokens + num_hit_blocks * self.block_size + num_new_tokens,
                             self.block_size)
        num_to_allocate = n * max(0, num_required - len(request.block_ids) // n - num_hit_blocks)
        if not self.prefixes.claim(request, computed_block_ids, num_to_allocate):
            return None
        new_block_ids = self.pool.take(num_to_allocate)
        request.block_ids.extend(computed_block_ids)
        request.block_ids.extend(new_block_ids)
        return new_block_ids

    def free(self, request: Request) -> None:
        """Release the request's blocks; blocks nobody else holds return to the free queue."""
        self.pool.release(self.detach(request))

    def detach(self, request: Request) -> list[int]:
        """Take the request's blocks away from it, still held: its KV is being copied to
        another executor, and the blocks must not be handed out before ``pool.release``.
        Returns the blocks it holds (its table without the window entries it gave back)."""
        table, request.block_ids = request.block_ids, []
        block_ids = self.windows.held_ids(request.request_id, table)
        self.prefixes.index.forget(request.request_id)
        self.windows.forget(request.request_id)
        return block_ids


def _check_hit(request: Request, computed_block_ids: Sequence[int]) -> None:
    if computed_block_ids and (request.block_ids or request.num_computed_tokens):
        raise ValueError(
            f"computed_block_ids given for request {request.request_id!r} that already holds "
            f"{len(request.block_ids)} blocks / {request.num_computed_tokens} computed tokens"
        )


def _check(num_blocks: int, block_size: int, group_windows: Sequence[int]) -> None:
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not group_windows or min(group_windows) < 0:
        raise ValueError(f"group_windows must be one window >= 0 per KV group, got {list(group_windows)}")
