"""KV groups in the block manager: window groups give back the blocks their window passed, and a
prefix hit takes the full groups' blocks of the whole prefix but the window groups' only where
its last window reads them (exact block ids, as test_block_manager.py)."""

from __future__ import annotations

import pytest

from services.common.kv_groups import first_needed_block, kv_groups
from services.scheduler.core.block_manager import PLACEHOLDER, BlockManager
from services.scheduler.request.request import Request

BS = 4
WINDOW = 6


def run_to(manager: BlockManager, request: Request, num_tokens: int) -> list[int]:
    new = manager.allocate_slots(request, num_tokens - request.num_computed_tokens)
    assert new is not None
    request.num_computed_tokens = num_tokens
    manager.computed(request)
    return new


def held(manager: BlockManager) -> list[int]:
    return [b.block_id for b in manager.pool.blocks if b.ref_count]


def test_groups_of_gemma3_and_of_uniform_models():
    gemma3 = kv_groups([512 if (i + 1) % 6 else None for i in range(18)], 18)
    assert gemma3.windows == (0, 512, 512, 512, 512, 512)
    assert gemma3.layers[0] == (5, 11, 17) and gemma3.layers[1] == (0, 1, 2) and gemma3.layers[5] == (14, 15, 16)
    assert gemma3.place(11) == (0, 1) and gemma3.place(16) == (5, 2)
    assert kv_groups((), 4).layers == ((0, 1, 2, 3),) and kv_groups((), 4).windows == (0,)
    assert kv_groups([8] * 3, 3).windows == (8,)
    # the next query at position 10 sees keys 5..10: block 1 on
    assert first_needed_block(10, WINDOW, BS) == 1 and first_needed_block(5, WINDOW, BS) == 0


def test_window_blocks_go_back_as_the_window_passes_and_full_ones_stay():
    manager = BlockManager(40, BS, group_windows=(0, WINDOW))
    request = Request("a", list(range(100, 120)))
    assert run_to(manager, request, 10) == [0, 1, 2, 3, 4, 5]  # (full, window) per block
    assert held(manager) == [0, 2, 3, 4, 5]  # block 0's window entry (1) is behind the window
    run_to(manager, request, 20)
    # the query at 20 reads keys from 15 on (block 3); the full group holds every block
    assert request.block_ids == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert held(manager) == [0, 2, 4, 6, 7, 8, 9]
    assert manager.pool.num_free == 40 - 7
    assert manager.pool.free_block_ids()[-3:] == [1, 3, 5]  # given back in order: the oldest is evicted first
    manager.free(request)
    assert held(manager) == [] and manager.pool.num_free == 40


def test_a_prefix_hit_takes_the_window_blocks_of_its_last_window_only():
    manager = BlockManager(40, BS, group_windows=(0, WINDOW))
    a = Request("a", list(range(100, 120)))
    run_to(manager, a, 20)
    manager.free(a)
    b = Request("b", list(range(100, 116)) + [7, 8])
    ids, tokens = manager.prefixes.get_computed_blocks(b)
    # 16 tokens hit: the next query (16) reads keys from 11, blocks 2 and 3 of the window group
    assert tokens == 16
    assert ids == [0, PLACEHOLDER, 2, PLACEHOLDER, 4, 5, 6, 7]
    assert manager.allocate_slots(b, 2, ids) == [10, 11]
    b.num_computed_tokens = 16
    assert held(manager) == [0, 2, 4, 5, 6, 7, 10, 11]
    manager.free(b)
    assert held(manager) == [] and manager.pool.num_free == 40


def test_a_prefix_whose_window_blocks_were_evicted_is_not_reused():
    manager = BlockManager(24, BS, group_windows=(0, WINDOW))
    a = Request("a", list(range(100, 120)))
    run_to(manager, a, 20)  # holds 7 blocks, gave back 1, 3, 5 (still cached)
    assert manager.pool.free_block_ids()[-3:] == [1, 3, 5]
    filler = Request("f", list(range(500, 529)))
    assert run_to(manager, filler, 29)[-2:] == [1, 3]  # the 14 never used, then evicts 1 and 3
    b = Request("b", list(range(100, 116)) + [7, 8])
    # 16 tokens need the window entries of blocks 2 and 3 only (5 cached, 7 held)
    assert manager.prefixes.get_computed_blocks(b) == ([0, PLACEHOLDER, 2, PLACEHOLDER, 4, 5, 6, 7], 16)
    assert run_to(manager, Request("g", list(range(700, 703))), 3)[0] == 5  # evicts 5
    # 16 would read block 2's window entry, gone; 12 blocks 1 and 2, 8 blocks 0 and 1: all gone
    assert manager.prefixes.get_computed_blocks(b) == ([], 0)
    assert manager.prefixes.index.cached_prefix_tokens(b.all_token_ids) == 16  # the full group alone still has it


def test_every_layer_windowed_frees_its_one_group():
    manager = BlockManager(10, BS, group_windows=(WINDOW,))
    request = Request("a", list(range(100, 121)))
    run_to(manager, request, 20)
    assert request.block_ids == [0, 1, 2, 3, 4] and held(manager) == [3, 4]
    b = Request("b", list(range(100, 116)) + [1])
    ids, tokens = manager.prefixes.get_computed_blocks(b)
    assert (ids, tokens) == ([PLACEHOLDER, PLACEHOLDER, 2, 3], 16)


@pytest.mark.parametrize("windows", [(0,), (0, WINDOW, WINDOW)])
def test_capacity_counts_each_group(windows):
    from services.scheduler.core.config import SchedulerConfig, SchedulerLimits

    config = SchedulerConfig(SchedulerLimits(), max_model_len=64, num_blocks=16 * len(windows) - 1, block_size=4,
                             vocab_size=10, kv_group_windows=windows)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        config.validate()


def test_a_4096_token_prompt_on_gemma3_holds_its_local_layers_at_the_window():
    """Gemma 3 270M: 3 global and 15 local layers (window 512), 1 KV head of 256, an fp32 pool of
    16-token blocks, the prompt in chunks of 2048 (the default step budget)."""
    groups = kv_groups([512 if (i + 1) % 6 else None for i in range(18)], 18)
    page_bytes = 2 * groups.layers_per_page * 16 * 1 * 256 * 4  # K and V of 3 layers, 16 tokens
    manager = BlockManager(4096, 16, group_windows=groups.windows)
    request = Request("long", list(range(4097)))
    most = 0
    for end in (2048, 4096):
        manager.allocate_slots(request, end - request.num_computed_tokens)
        most = max(most, 4096 - manager.pool.num_free)
        request.num_computed_tokens = end
        manager.computed(request)
    held = 4096 - manager.pool.num_free
    # the full group: 256 blocks; each of 5 local groups: the 32 blocks of its last 512 tokens
    assert held == 256 + 5 * 32
    assert held * page_bytes // 4096 == 9_984  # bytes a token, against 36,864 with every block kept
    assert 18 * 2 * 256 * 4 == 36_864
    # at most: the first chunk's full blocks and last window, and every group's blocks of the second
    assert most == 128 + 5 * 32 + 6 * 128
