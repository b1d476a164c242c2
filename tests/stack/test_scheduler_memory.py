"""The scheduler's memory across an executor loss (a real in-process stack).

run_service freezes the objects alive at start-up out of the cyclic GC (gc.freeze), the
scheduler core among them. The core's free-block list is a cycle of KVBlocks, so the blocks of
a core dropped when its executor goes away are freed only if the loop unfreezes: otherwise
every block of the first KV pool stays in memory for good. The loop also collects at once, so
they are free before a new core is built.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

import pytest

from tests.helpers.small_stack import start_small_stack

pytestmark = pytest.mark.asyncio

# The block manager's collaborators (pool, free queue, prefix reuse, windows) all live here; the
# test's lower bound on what a fresh core holds fails if a move takes the blocks elsewhere.
BLOCK_FILES = [tracemalloc.Filter(True, "*/scheduler/core/*.py")]


def block_bytes() -> int:
    """Bytes still allocated by the block manager's and free-block queue's code."""
    snapshot = tracemalloc.take_snapshot().filter_traces(BLOCK_FILES)
    return sum(stat.size for stat in snapshot.statistics("filename"))


async def test_the_blocks_of_a_lost_executors_core_are_freed_even_when_frozen_at_start_up() -> None:
    tracemalloc.start()
    try:
        stack = await start_small_stack(num_blocks=512)
        core = stack.scheduler.app.core
        held = block_bytes()
        assert held > 512 * 50, held  # the core's 512 KVBlocks and their table
        gc.freeze()  # as run_service does once the server has started
        await stack.executor.stop(grace=0)
        for _ in range(400):  # the executor is not restarted: the loop stays without a core
            if not core.lanes:
                break
            await asyncio.sleep(0.01)
        assert not core.lanes, "the engine did not notice the executor's loss"
        # Freed at once, by the loop's own collection: not left for a later full collection
        # while a new core and the resumed load take fresh memory.
        assert block_bytes() < held / 10, (block_bytes(), held)
    finally:
        gc.unfreeze()
        tracemalloc.stop()
        await stack.channel.close()
        for running in (stack.scheduler, stack.tokenizer):
            await running.stop(grace=0)
