"""Which KV-cache blocks each request uses, with prefix caching over full blocks.

The scheduler owns block accounting, the executor owns the memory: this class decides block
ids; the executor writes K/V where the plan says.

Two collaborators hold the state: the pool (block_pool.py: ref counts and the free queue) and
the prefix cache's index (prefix_cache.py: which block caches which prefix). A request whose
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
from services.scheduler.core.window_tables import PLACEHOLDER, WindowTables

if TYPE_CHECKING:
    from services.scheduler.request.request import Request

__all__ = ["PLACEHOLDER", "BlockManager", "hash_block_tokens", "scope_root_hash"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates blocks to requests, shares cached prefix blocks, evicts LRU cached blocks.

    Every request's block table is ``request.block_ids``; this class is the only writer.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: Sequence[int] = (0,)) -> None:
        _check(num_blocks, block_size, group_windows)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._windows = WindowTables(block_size, group_windows)
        self.group_windows = self._windows.group_windows
        """Per KV group, its sliding window in tokens (0: full attention); see window_tables.py."""
        self.num_groups = self._windows.num_groups
        self._prefixes = PrefixCache(block_size)
        self._pool = BlockPool(num_blocks, self._prefixes.evict)
        self.blocks = self._pool.blocks
        self.prefix_cache_queries = 0
        """Tokens looked up in the prefix cache (request length at each first allocation)."""
        self.prefix_cache_hits = 0
        """Tokens of those lookups served from the cache."""

    # ---- state ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return self._pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return (self.num_blocks - self._pool.num_free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._prefixes)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (next handed out first). O(n): tests, debugging."""
        return self._pool.free_block_ids()

    # ---- prefix cache --------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request, in full blocks: (block ids, tokens covered).

        Never the whole sequence: at least the last token is left to compute, so the step
        produces logits to sample from. None for a request that still needs prompt logprobs:
        their positions must be computed (vLLM skips the cache for them too). Pure lookup:
        nothing is claimed until allocate_slots.
        """
        if not self.enable_prefix_caching or request.block_ids or request.needs_prompt_logprobs:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = self._prefixes.cached_rows(request, max_hit_blocks, self.num_groups, self._windows.full_groups)
        table = self._windows.hit_table(hits)
        return table, len(table) // self.num_groups * self.block_size

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's fully computed blocks in the prefix cache.

        Call after request.num_computed_tokens advanced. Only confirmed tokens count (computed
        by a step whose result was applied, hence known): a block that a step in flight still
        writes, or that holds a token not sampled yet, is never cached. When another block
        already caches the same prefix (two requests computed it at once), the first one stays
        the cached copy and this one remains private.
        """
        if not self.enable_prefix_caching:
            return
        n = self.num_groups
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids) // n)
        start = self._prefixes.registered.get(request.request_id, 0)
        if num_full <= start:
            return
        self._prefixes.register(request, num_full, (
            (index, k, self.blocks[request.block_ids[index * n + k]])
            for index in range(start, num_full) for k in self._windows.holds(request.request_id, index)))

    def computed(self, request: Request) -> None:
        """After request.num_computed_tokens advanced: cache its full blocks, then give back the
        window groups' blocks that its next query's window has passed (still cached, they stay
        reusable by a later prefix until evicted). Queries of steps in flight come later still,
        so they read none of them; nothing writes them again."""
        self.cache_full_blocks(request)
        if any(self.group_windows):
            passed = self._windows.passed(request.request_id, request.block_ids, request.num_computed_tokens)
            self.release(passed[::-1])  # release() appends in reverse: the oldest is evicted first

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_block_ids: Sequence[int] = (),
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the request's planned ones
        (computed, plus those the steps in flight compute: ``request.num_planned_tokens``).

        ``computed_block_ids``: prefix-cache hits from get_computed_blocks, claimed now; only for
        a request that holds no blocks yet, before its num_computed_tokens is set to the hit.
        Returns the newly allocated block ids (appended to request.block_ids after the hits),
        or None, changing nothing, when there are not enough free blocks.
        """
        if computed_block_ids and (request.block_ids or request.num_computed_tokens):
            raise ValueError(
                f"computed_block_ids given for request {request.request_id!r} that already holds "
                f"{len(request.block_ids)} blocks / {request.num_computed_tokens} computed tokens"
            )
        is_first_allocation = not request.block_ids
        n = self.num_groups
        num_hit_blocks = len(computed_block_ids) // n
        num_planned = request.num_planned_tokens + num_hit_blocks * self.block_size
        num_required = _cdiv(num_planned + num_new_tokens, self.block_size)
        num_to_allocate = n * max(0, num_required - len(request.block_ids) // n - num_hit_blocks)
        # The hit's entries the request holds (not a window group's placeholders before its window).
        claimed, window_start = self._windows.claimed(computed_block_ids)
        # A hit on a free (cached, unreferenced) block takes it out of the free pool too.
        if num_to_allocate + self._pool.num_free_among(claimed) > self._pool.num_free:
            return None
        self._pool.claim(claimed)
        if is_first_allocation and window_start:
            self._windows.set_start(request.request_id, window_start)
        new_block_ids = self._pool.take(num_to_allocate)
        request.block_ids.extend(computed_block_ids)
        request.block_ids.extend(new_block_ids)

        if is_first_allocation and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_blocks * self.block_size
        return new_block_ids

    def free(self, request: Request) -> None:
        """Release the request's blocks; blocks nobody else holds return to the free queue.

        In reverse order: the tail of a sequence is its least shareable part, so it is appended
        first and evicted before the prefix blocks that other prompts are likelier to reuse.
        """
        self.release(self.detach(request))

    def detach(self, request: Request) -> list[int]:
        """Take the request's blocks away from it, still held: its KV is being copied to
        another executor, and the blocks must not be handed out before ``release``. Returns the
        blocks it holds (its table without the window entries it gave back)."""
        table, request.block_ids = request.block_ids, []
        block_ids = self._windows.held_ids(request.request_id, table)
        self._prefixes.forget(request.request_id)
        self._windows.forget(request.request_id)
        return block_ids

    def release(self, block_ids: list[int]) -> None:
        """Drop one hold on each block (see ``free``); those nobody holds become free."""
        self._pool.release(block_ids)

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_scope: str = "") -> int:
        """Tokens of ``token_ids`` this pool's prefix cache holds for ``cache_scope``, in full
        blocks (never the last token): a placement probe that records nothing."""
        return self._prefixes.cached_prefix_tokens(token_ids, cache_scope) if self.enable_prefix_caching else 0


def _check(num_blocks: int, block_size: int, group_windows: Sequence[int]) -> None:
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not group_windows or min(group_windows) < 0:
        raise ValueError(f"group_windows must be one window >= 0 per KV group, got {list(group_windows)}")
