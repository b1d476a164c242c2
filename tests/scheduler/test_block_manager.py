"""BlockManager and FreeBlockQueue: exact block ids, eviction order, prefix hits, ref counts."""

from __future__ import annotations

import pytest

from services.scheduler.core.block_manager import BlockManager, hash_block_tokens
from services.scheduler.core.free_block_queue import FreeBlockQueue, KVBlock
from services.scheduler.request.request import Request

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids)


def compute_all(manager: BlockManager, request: Request) -> None:
    """Allocate slots for every token, mark them computed and cache the full blocks."""
    new = manager.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    manager.prefixes.cache_full_blocks(request)


def ref_counts(manager: BlockManager) -> list[int]:
    return [block.ref_count for block in manager.pool.blocks]


# ---- FreeBlockQueue ----------------------------------------------------------------------


def test_free_queue_pops_in_order_and_removes_from_the_middle():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3, 4]

    queue.remove(blocks[2])
    # The neighbours are linked to each other directly: no traversal was needed.
    assert blocks[1].next_free is blocks[3]
    assert blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert not blocks[2].is_free
    assert len(queue) == 4

    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert queue.block_ids() == [1, 3, 4, 2, 0]
    assert len(queue) == 5


def test_free_queue_rejects_misuse():
    blocks = [KVBlock(i) for i in range(2)]
    queue = FreeBlockQueue(blocks)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[0])
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    assert len(queue) == 0 and queue.block_ids() == []


# ---- allocation and free -----------------------------------------------------------------


def test_allocate_hands_out_blocks_in_id_order_and_reports_usage():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(10)))
    assert manager.allocate_slots(request, 10) == [0, 1, 2]
    assert request.block_ids == [0, 1, 2]
    assert manager.pool.num_free == 7
    assert manager.pool.usage == pytest.approx(0.3)
    assert ref_counts(manager)[:4] == [1, 1, 1, 0]


def test_allocate_appends_a_block_only_when_the_last_one_is_full():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(10)))
    manager.allocate_slots(request, 10)
    request.num_computed_tokens = 10
    assert manager.allocate_slots(request, 2) == []  # 12 tokens still fit in 3 blocks
    assert manager.allocate_slots(request, 3) == [3]  # 13 tokens need a 4th
    assert manager.allocate_slots(request, 11) == [4, 5]  # room for 21 tokens: 6 blocks
    assert request.block_ids == [0, 1, 2, 3, 4, 5]


def test_allocate_returns_none_and_changes_nothing_when_blocks_run_out():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(12)))
    assert manager.allocate_slots(first, 12) == [0, 1, 2]
    second = make_request("b", list(range(8)))
    assert manager.allocate_slots(second, 8) is None
    assert second.block_ids == []
    assert manager.pool.num_free == 1
    assert manager.pool.free_block_ids() == [3]
    assert manager.prefixes.queries == 12  # the failed attempt is not counted


def test_free_returns_blocks_to_the_tail_in_reverse_order():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(12)))
    second = make_request("b", list(range(100, 108)))
    manager.allocate_slots(first, 12)  # [0, 1, 2]
    manager.allocate_slots(second, 8)  # [3, 4]
    manager.free(first)
    assert first.block_ids == []
    assert manager.pool.free_block_ids() == [5, 6, 7, 2, 1, 0]
    manager.free(second)
    assert manager.pool.free_block_ids() == [5, 6, 7, 2, 1, 0, 4, 3]
    assert manager.pool.num_free == 8
    assert manager.pool.usage == 0.0
    assert ref_counts(manager) == [0] * 8


def test_double_free_is_an_error():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(4)))
    manager.allocate_slots(request, 4)
    held = list(request.block_ids)
    manager.free(request)
    request.block_ids = held
    with pytest.raises(RuntimeError, match="freed more often than allocated"):
        manager.free(request)


# ---- prefix caching ----------------------------------------------------------------------


def test_prefix_hit_returns_exact_block_ids_and_shares_them():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(10)))
    compute_all(manager, first)  # blocks [0, 1, 2]; 0 and 1 are full and cached
    assert len(manager.prefixes.index) == 2
    assert manager.pool.blocks[0].block_hash == hash_block_tokens(b"", [0, 1, 2, 3])
    assert manager.pool.blocks[1].block_hash == hash_block_tokens(
        manager.pool.blocks[0].block_hash, [4, 5, 6, 7]
    )
    assert manager.pool.blocks[2].block_hash is None  # partial block: never cached

    second = make_request("b", list(range(8)) + [50, 51, 52])
    hit_block_ids, num_hit_tokens = manager.prefixes.get_computed_blocks(second)
    assert (hit_block_ids, num_hit_tokens) == ([0, 1], 8)
    assert manager.allocate_slots(second, 3, hit_block_ids) == [3]
    assert second.block_ids == [0, 1, 3]
    assert ref_counts(manager)[:5] == [2, 2, 1, 1, 0]
    assert (manager.prefixes.queries, manager.prefixes.hits) == (10 + 11, 8)

    # The shared blocks survive the first request's end and return only after the second's.
    manager.free(first)
    assert manager.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2]
    assert ref_counts(manager)[:4] == [1, 1, 0, 1]
    manager.free(second)
    assert manager.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]


def test_whole_sequence_is_never_a_hit():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    compute_all(manager, make_request("a", list(range(8))))  # two full cached blocks
    same = make_request("b", list(range(8)))
    # 8 tokens, all cached: the last block is left to compute so the step yields logits.
    assert manager.prefixes.get_computed_blocks(same) == ([0], 4)
    longer = make_request("c", list(range(9)))
    assert manager.prefixes.get_computed_blocks(longer) == ([0, 1], 8)


def test_hash_chain_needs_the_same_prefix_not_just_the_same_block():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    compute_all(manager, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other_prefix = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert manager.prefixes.get_computed_blocks(other_prefix) == ([], 0)
    first_block_only = make_request("c", [1, 2, 3, 4, 0, 6, 7, 8, 9])
    assert manager.prefixes.get_computed_blocks(first_block_only) == ([0], 4)


def test_hit_on_a_free_cached_block_takes_it_from_the_middle_of_the_queue():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(9)))
    compute_all(manager, first)  # [0, 1, 2]
    manager.free(first)
    assert manager.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]

    second = make_request("b", list(range(8)) + [99])
    hit_block_ids, num_hit_tokens = manager.prefixes.get_computed_blocks(second)
    assert (hit_block_ids, num_hit_tokens) == ([0, 1], 8)
    assert manager.allocate_slots(second, 1, hit_block_ids) == [3]
    assert second.block_ids == [0, 1, 3]
    assert manager.pool.free_block_ids() == [4, 5, 2]
    assert manager.pool.num_free == 3


def test_allocation_counts_free_cached_hits_against_free_blocks():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(9)))
    compute_all(manager, first)  # [0, 1, 2]
    manager.free(first)
    blocker = make_request("x", [70])
    manager.allocate_slots(blocker, 1)  # takes block 3, the head
    assert manager.pool.free_block_ids() == [2, 1, 0]
    # Hits on blocks 0 and 1 (both free) plus 3 new blocks: 5 > 3 free blocks.
    second = make_request("b", list(range(8)) + list(range(100, 112)))
    hit_block_ids, _ = manager.prefixes.get_computed_blocks(second)
    assert hit_block_ids == [0, 1]
    assert manager.allocate_slots(second, 12, hit_block_ids) is None
    assert ref_counts(manager) == [0, 0, 0, 1]
    assert manager.pool.free_block_ids() == [2, 1, 0]
    # One new block fits: hits 0 and 1 plus block 2 (the head; uncached, nothing evicted).
    assert manager.allocate_slots(second, 4, hit_block_ids) == [2]
    assert second.block_ids == [0, 1, 2]
    assert len(manager.prefixes.index) == 2


def test_eviction_takes_the_least_recently_freed_cached_blocks_first():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(8)))  # blocks [0, 1], both full
    second = make_request("b", list(range(100, 108)))  # blocks [2, 3]
    compute_all(manager, first)
    compute_all(manager, second)
    manager.free(first)
    manager.free(second)
    assert manager.pool.free_block_ids() == [1, 0, 3, 2]
    assert len(manager.prefixes.index) == 4

    # A fresh request needing two blocks evicts 1 then 0: the first request's tail first.
    fresh = make_request("c", list(range(200, 208)))
    assert manager.allocate_slots(fresh, 8) == [1, 0]
    assert manager.pool.blocks[0].block_hash is None and manager.pool.blocks[1].block_hash is None
    assert len(manager.prefixes.index) == 2
    assert manager.prefixes.get_computed_blocks(make_request("d", list(range(9)))) == ([], 0)
    assert manager.prefixes.get_computed_blocks(make_request("e", list(range(100, 109)))) == ([2, 3], 8)


def test_evicting_only_the_tail_keeps_the_prefix_hit():
    manager = BlockManager(num_blocks=3, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(8)))
    compute_all(manager, first)  # [0, 1]
    manager.free(first)
    assert manager.pool.free_block_ids() == [2, 1, 0]
    taker = make_request("t", [90, 91, 92, 93, 94])
    assert manager.allocate_slots(taker, 5) == [2, 1]  # block 1 (the tail) is evicted
    assert manager.prefixes.get_computed_blocks(make_request("b", list(range(9)))) == ([0], 4)


def test_same_prefix_computed_twice_keeps_the_first_cached_copy():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(5)))
    second = make_request("b", list(range(5)))
    manager.allocate_slots(first, 5)  # [0, 1]
    manager.allocate_slots(second, 5)  # [2, 3]: no hit, nothing was computed yet
    for request in (first, second):
        request.num_computed_tokens = 5
        manager.prefixes.cache_full_blocks(request)
    assert len(manager.prefixes.index) == 1
    assert manager.pool.blocks[0].block_hash is not None
    assert manager.pool.blocks[2].block_hash is None
    manager.free(first)
    manager.free(second)
    assert manager.prefixes.get_computed_blocks(make_request("c", list(range(6)))) == ([0], 4)


def test_cache_full_blocks_follows_num_computed_tokens():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(14)))
    manager.allocate_slots(request, 6)  # a first chunk of 6 tokens: blocks [0, 1]
    request.num_computed_tokens = 6
    manager.prefixes.cache_full_blocks(request)
    assert [b.block_hash is not None for b in manager.pool.blocks[:4]] == [True, False, False, False]
    manager.allocate_slots(request, 8)  # the rest: blocks [2, 3]
    request.num_computed_tokens = 14
    manager.prefixes.cache_full_blocks(request)
    assert [b.block_hash is not None for b in manager.pool.blocks[:4]] == [True, True, True, False]


def test_disabled_prefix_caching_never_hits_nor_counts():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    first = make_request("a", list(range(9)))
    compute_all(manager, first)
    manager.free(first)
    assert len(manager.prefixes.index) == 0
    assert manager.prefixes.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert (manager.prefixes.queries, manager.prefixes.hits) == (0, 0)


def test_computed_blocks_only_for_a_request_without_blocks():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    compute_all(manager, make_request("a", list(range(9))))
    request = make_request("b", list(range(9)))
    manager.allocate_slots(request, 1)
    with pytest.raises(ValueError, match="computed_block_ids given"):
        manager.allocate_slots(request, 1, [0])


@pytest.mark.parametrize(("num_blocks", "block_size", "field"), [(0, 4, "num_blocks"), (4, 0, "block_size")])
def test_constructor_rejects_empty_sizes(num_blocks, block_size, field):
    with pytest.raises(ValueError, match=field):
        BlockManager(num_blocks=num_blocks, block_size=block_size)


def test_prefixes_are_cached_per_scope():
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    tokens = list(range(1, 11))  # two full blocks and a tail
    owner = Request("owner", tokens, cache_scope="tenant:a")
    compute_all(manager, owner)
    owner_blocks = owner.block_ids[:2]
    manager.free(owner)
    # Another tenant's identical prompt finds nothing (no shared block, no cached_tokens to read).
    assert manager.prefixes.get_computed_blocks(Request("other", tokens, cache_scope="tenant:b")) == ([], 0)
    assert manager.prefixes.get_computed_blocks(Request("unscoped", tokens)) == ([], 0)
    assert manager.prefixes.index.cached_prefix_tokens(tokens, "tenant:b") == 0
    # The same scope reuses it, as before.
    again = Request("again", tokens, cache_scope="tenant:a")
    assert manager.prefixes.get_computed_blocks(again) == (owner_blocks, 8)
    assert manager.prefixes.index.cached_prefix_tokens(tokens, "tenant:a") == 8
