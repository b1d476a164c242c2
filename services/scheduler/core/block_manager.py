"""Which KV-cache blocks each request uses, with prefix caching over full blocks.

The scheduler owns block accounting, the executor owns the memory: this class decides block
ids; the executor writes K/V where the plan says.

Prefix caching: once every token of a full block has been computed, the block is registered
under a hash of its token ids chained with the hash of the block before it, so a hash names
the whole prefix up to the end of the block. The first block's parent is the request's cache
scope (``Request.cache_scope``: by default its tenant, see services/scheduler/auth.py), so a
tenant can neither reuse another's K/V nor learn from ``cached_tokens`` or its time to first
token that another tenant sent a prefix; tenants share only when their operator puts them in
one cache group. A later request whose prompt starts with the same
full blocks reuses them (ref counts > 1) instead of recomputing. When a request finishes, its
blocks go back to the free queue but keep their hash: they stay reusable until the allocator
needs them for something else (eviction, least recently freed first).

Block 0 is an ordinary block. No "null" block is reserved: padding entries of a block table
are never read (context lengths bound every gather) and padded slots use slot id -1, so the
executor needs no dummy block.

Sliding windows (services/common/kv_groups.py): a model mixing window and full-attention layers
has several KV groups, and a request's block table interleaves them (entry ``i * num_groups +
k`` is group ``k``'s block for the ``i``-th ``block_size`` tokens). Once a window group's block
lies wholly before the window of the request's next query, the request gives it back
(``computed``); its entry stays in the table (the executor never reads it again: every backend
attends within the window) but the block is free, and keeps its prefix hash until evicted. A
prefix hit then needs the full groups' blocks of the whole prefix but the window groups' blocks
of its last window only; the entries before that are ``PLACEHOLDER``, held by no one and never
read. ``_window_start`` records, per request, the first block whose window-group entries it
holds.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.common.kv_groups import first_needed_block
from services.scheduler.core.free_block_queue import FreeBlockQueue, KVBlock

if TYPE_CHECKING:
    from services.scheduler.request.request import Request


def scope_root_hash(cache_scope: str) -> bytes:
    """The parent hash of a prefix's first block: empty for the shared scope (""), else a digest
    of the scope, so two scopes never name the same prefix and never share its blocks."""
    if not cache_scope:
        return b""
    return hashlib.sha256(b"tokenmill prefix scope\0" + cache_scope.encode("utf-8", "surrogatepass")).digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of (parent hash, token ids of one full block): names the whole prefix.

    SHA-256 rather than Python's hash(): hash() of int tuples is not randomized, so a client
    could craft a prompt colliding with another client's prefix and read attention over K/V it
    never sent. The digest is process-local (native byte order), never persisted.
    """
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


PLACEHOLDER = 0
"""A window group's table entry the request does not hold (before its window since a prefix
hit): any valid id, never read."""


class BlockManager:
    """Allocates blocks to requests, shares cached prefix blocks, evicts LRU cached blocks.

    Every request's block table is ``request.block_ids``; this class is the only writer.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: Sequence[int] = (0,)) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not group_windows or min(group_windows) < 0:
            raise ValueError(f"group_windows must be one window >= 0 per KV group, got {list(group_windows)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        """Per KV group, its sliding window in tokens (0: full attention); see the module docstring."""
        self.num_groups = len(self.group_windows)
        self._window_start: dict[str, int] = {}
        """Per request with window groups: its first block whose window-group entries it holds."""
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self._free_queue = FreeBlockQueue(self.blocks)
        self._cached_blocks: dict[bytes, KVBlock] = {}
        """Prefix hash -> the block holding that prefix's last block of K/V."""
        self._block_hashes: dict[str, list[bytes]] = {}
        """Per request: hash chain of its full blocks, computed lazily as tokens arrive."""
        self._num_registered_blocks: dict[str, int] = {}
        """Per request: how many leading blocks cache_full_blocks already handled."""
        self.prefix_cache_queries = 0
        """Tokens looked up in the prefix cache (request length at each first allocation)."""
        self.prefix_cache_hits = 0
        """Tokens of those lookups served from the cache."""

    # ---- state ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return (self.num_blocks - len(self._free_queue)) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_blocks)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (next handed out first). O(n): tests, debugging."""
        return self._free_queue.block_ids()

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
        hashes = self._hashes_for(request, max_hit_blocks)
        n = self.num_groups
        full = [k for k, w in enumerate(self.group_windows) if not w]
        hits: list[list[KVBlock | None]] = []  # per block, per group: the cached block or None
        for block_hash in hashes[:max_hit_blocks]:
            row = [self._cached_blocks.get(self._key(block_hash, k)) for k in range(n)]
            if any(row[k] is None for k in full):
                break
            hits.append(row)
        # The longest prefix whose window groups hold every block their last window reads.
        num_hit = len(hits)
        while num_hit > 0 and not self._window_blocks_cached(hits, num_hit):
            num_hit -= 1
        first = self._first_needed(num_hit * self.block_size)
        table: list[int] = []
        for index in range(num_hit):
            for k in range(n):
                block = hits[index][k]
                held = not self.group_windows[k] or index >= first
                table.append(block.block_id if held else PLACEHOLDER)
        return table, num_hit * self.block_size

    def _window_blocks_cached(self, hits: list[list[KVBlock | None]], num_hit: int) -> bool:
        first = self._first_needed(num_hit * self.block_size)
        return all(hits[index][k] is not None for index in range(first, num_hit)
                   for k, window in enumerate(self.group_windows) if window)

    def _first_needed(self, num_computed_tokens: int) -> int:
        """The first block whose window-group entries a request with this many computed tokens
        still reads: one bound for every window group, that of the widest window."""
        return min((first_needed_block(num_computed_tokens, w, self.block_size) for w in self.group_windows if w),
                   default=0)

    def _key(self, block_hash: bytes, group: int) -> bytes:
        """A group's blocks are cached apart: one prefix names a block in each group."""
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    def _holds(self, request_id: str, index: int) -> list[int]:
        """The groups whose entries of block ``index`` the request holds."""
        start = self._window_start.get(request_id, 0)
        return [k for k, w in enumerate(self.group_windows) if not w or index >= start]

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
        start = self._num_registered_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes_for(request, num_full)
        for index in range(start, num_full):
            for k in self._holds(request.request_id, index):
                block = self.blocks[request.block_ids[index * n + k]]
                if block.block_hash is not None:
                    continue  # a prefix hit: already cached under this very hash
                key = self._key(hashes[index], k)
                if key not in self._cached_blocks:
                    block.block_hash = key
                    self._cached_blocks[key] = block
        self._num_registered_blocks[request.request_id] = num_full

    def computed(self, request: Request) -> None:
        """After request.num_computed_tokens advanced: cache its full blocks, then give back the
        window groups' blocks that its next query's window has passed (still cached, they stay
        reusable by a later prefix until evicted). Queries of steps in flight come later still,
        so they read none of them; nothing writes them again."""
        self.cache_full_blocks(request)
        if not any(self.group_windows):
            return
        first = min(self._first_needed(request.num_computed_tokens), len(request.block_ids) // self.num_groups)
        start = self._window_start.get(request.request_id, 0)
        if first <= start:
            return
        n = self.num_groups
        released = [request.block_ids[index * n + k] for index in range(start, first)
                    for k, w in enumerate(self.group_windows) if w]
        self._window_start[request.request_id] = first
        self.release(released[::-1])  # release() appends in reverse: the oldest is evicted first

    def _hashes_for(self, request: Request, num_blocks: int) -> list[bytes]:
        hashes = self._block_hashes.setdefault(request.request_id, [])
        token_ids = request.all_token_ids
        size = self.block_size
        while len(hashes) < num_blocks:
            index = len(hashes)
            parent = hashes[-1] if hashes else scope_root_hash(request.cache_scope)
            hashes.append(hash_block_tokens(parent, token_ids[index * size : (index + 1) * size]))
        return hashes

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
        window_start = self._first_needed(num_hit_blocks * self.block_size)
        claimed = [block_id for index in range(num_hit_blocks) for k, block_id in
                   enumerate(computed_block_ids[index * n:(index + 1) * n])
                   if not self.group_windows[k] or index >= window_start]
        # A hit on a free (cached, unreferenced) block takes it out of the free pool too.
        num_free_hits = sum(1 for b in claimed if self.blocks[b].ref_count == 0)
        if num_to_allocate + num_free_hits > len(self._free_queue):
            return None

        for block_id in claimed:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._free_queue.remove(block)
            block.ref_count += 1
        if is_first_allocation and window_start:
            self._window_start[request.request_id] = window_start
        new_block_ids = [self._take_free_block().block_id for _ in range(num_to_allocate)]
        request.block_ids.extend(computed_block_ids)
        request.block_ids.extend(new_block_ids)

        if is_first_allocation and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_blocks * self.block_size
        return new_block_ids

    def _take_free_block(self) -> KVBlock:
        block = self._free_queue.popleft()
        if block.block_hash is not None:  # evict: its prefix is no longer cached
            if self._cached_blocks.get(block.block_hash) is block:
                del self._cached_blocks[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block

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
        n = self.num_groups
        block_ids = [table[index * n + k] for index in range(len(table) // n)
                     for k in self._holds(request.request_id, index)]
        self._block_hashes.pop(request.request_id, None)
        self._num_registered_blocks.pop(request.request_id, None)
        self._window_start.pop(request.request_id, None)
        return block_ids

    def release(self, block_ids: list[int]) -> None:
        """Drop one hold on each block (see ``free``); those nobody holds become free."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue.append(block)

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_scope: str = "") -> int:
        """Tokens of ``token_ids`` this pool's prefix cache holds for ``cache_scope``, in full
        blocks (never the last token): a placement probe that records nothing."""
        if not self.enable_prefix_caching:
            return 0
        size = self.block_size
        parent = scope_root_hash(cache_scope)
        hits = 0
        for index in range((len(token_ids) - 1) // size):
            parent = hash_block_tokens(parent, token_ids[index * size : (index + 1) * size])
            if parent not in self._cached_blocks:  # group 0: a full group when there is one
                break
            hits += 1
        return hits * size
