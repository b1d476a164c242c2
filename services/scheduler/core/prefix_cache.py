"""The prefix cache's index: which block caches which prefix, and each request's hash chain.

Once every token of a full block has been computed, the block is registered under a hash of
its token ids chained with the hash of the block before it, so a hash names the whole prefix
up to the end of the block. The first block's parent is the request's cache scope
(``Request.cache_scope``: by default its tenant, see services/scheduler/auth.py), so a tenant
can neither reuse another's K/V nor learn from ``cached_tokens`` or its time to first token
that another tenant sent a prefix; tenants share only when their operator puts them in one
cache group. Each KV group's blocks are cached apart: one prefix names a block in each group.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from services.scheduler.core.free_block_queue import KVBlock

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


def group_key(block_hash: bytes, group: int) -> bytes:
    """A group's blocks are cached apart: one prefix names a block in each group."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: dict[bytes, KVBlock] = {}
        """Prefix hash (group_key) -> the block holding that prefix's last block of K/V."""
        self._hashes: dict[str, list[bytes]] = {}
        """Per request: hash chain of its full blocks, computed lazily as tokens arrive."""
        self.registered: dict[str, int] = {}
        """Per request: its leading blocks ``register`` handled."""

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_rows(self, request: Request, max_blocks: int, num_groups: int,
                    needed_groups: Sequence[int]) -> list[list[KVBlock | None]]:
        """Per leading full block of ``request`` (at most ``max_blocks``), per group, the block
        caching it or None; up to the first block one of ``needed_groups`` misses."""
        rows = []
        for block_hash in self.hashes_for(request, max_blocks)[:max_blocks]:
            row = [self._blocks.get(group_key(block_hash, k)) for k in range(num_groups)]
            if any(row[k] is None for k in needed_groups):
                break
            rows.append(row)
        return rows

    def register(self, request: Request, num_full: int, held: Iterable[tuple[int, int, KVBlock]]) -> None:
        """Cache ``held`` ((block index, group, block), those before ``num_full`` not registered
        yet). A prefix hit is cached already; when another block caches the same prefix (two
        requests computed it at once), that one stays the cached copy, this one private."""
        hashes = self.hashes_for(request, num_full)
        for index, group, block in held:
            if block.block_hash is not None:
                continue
            key = group_key(hashes[index], group)
            if key not in self._blocks:
                block.block_hash = key
                self._blocks[key] = block
        self.registered[request.request_id] = num_full

    def evict(self, block: KVBlock) -> None:
        if self._blocks.get(block.block_hash) is block:
            del self._blocks[block.block_hash]

    def forget(self, request_id: str) -> None:
        """The request let go of its blocks: its chain and count go (its cached blocks stay)."""
        self._hashes.pop(request_id, None)
        self.registered.pop(request_id, None)

    def hashes_for(self, request: Request, num_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(request.request_id, [])
        _extend_chain(hashes, request.all_token_ids, request.cache_scope, self.block_size, num_blocks)
        return hashes

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_scope: str = "") -> int:
        """Tokens of ``token_ids`` cached for ``cache_scope``, in full blocks (never the last
        token): a placement probe that records nothing."""
        return _probe(self._blocks, token_ids, cache_scope, self.block_size)


def _probe(cached: dict[bytes, KVBlock], token_ids: Sequence[int], cache_scope: str, size: int) -> int:
    parent = scope_root_hash(cache_scope)
    for index in range((len(token_ids) - 1) // size):
        parent = hash_block_tokens(parent, token_ids[index * size : (index + 1) * size])
        if parent not in cached:  # group 0: a full group when there is one
            return index * size
    return (len(token_ids) - 1) // size * size


def _extend_chain(hashes: list[bytes], token_ids: Sequence[int], cache_scope: str, size: int, num_blocks: int) -> None:
    """Extend a request's hash chain to its first ``num_blocks`` full blocks."""
    while len(hashes) < num_blocks:
        index = len(hashes)
        parent = hashes[-1] if hashes else scope_root_hash(cache_scope)
        hashes.append(hash_block_tokens(parent, token_ids[index * size : (index + 1) * size]))
