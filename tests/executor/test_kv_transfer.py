"""The executor's side of KV copies (services/executor/kv_transfer.py): the reader refuses a
pool of another layout, ids outside the pool and ill-matched requests are refused naming the
field, and reads come in chunks that cover the blocks in order."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from services.common.pb.tokenmill.v1 import executor_pb2_grpc
from services.common.server import start_server
from services.executor import kv_transfer
from services.executor.kv_transfer import KVTransfer
from services.runtime.kv_blocks import kv_layout, read_blocks
from services.runtime.kv_cache import KVCache, bytes_per_block
from tests.runtime.test_kv_blocks import CONFIG

LAYOUT = kv_layout(CONFIG, 16, torch.float32, torch.float32)


async def _now(fn, *args):
    return fn(*args)


def _transfer(num_blocks: int = 8) -> tuple[KVTransfer, KVCache]:
    cache = KVCache.allocate(CONFIG, num_blocks, 16, torch.float32, torch.device("cpu"))
    for k, v in cache.layers:
        k.normal_()
        v.normal_()
    return KVTransfer(cache, LAYOUT, bytes_per_block(CONFIG, 16, torch.float32), num_blocks, _now), cache


async def test_reads_come_in_chunks_covering_the_blocks_in_order(monkeypatch):
    monkeypatch.setattr(kv_transfer, "CHUNK_BYTES", 2 * bytes_per_block(CONFIG, 16, torch.float32))
    transfer, cache = _transfer()
    chunks = [chunk async for chunk in transfer.read(LAYOUT, [7, 1, 4, 0, 2])]
    assert [(first, count) for first, count, _ in chunks] == [(0, 2), (2, 2), (4, 1)]
    assert [layers for _, _, layers in chunks][1] == read_blocks(cache, [4, 0])


async def test_a_reader_of_another_layout_is_refused():
    transfer, _ = _transfer()
    other = kv_layout(CONFIG, 32, torch.float32, torch.float32)
    with pytest.raises(FailedPreconditionError, match="is not this executor's"):
        [chunk async for chunk in transfer.read(other, [0])]


@pytest.mark.parametrize(("source", "target", "message"), [
    ([0, 1], [2], "source_block_ids has 2 entries and block_ids 1"),
    ([0, 1], [3, 3], "block_ids names a block more than once"),
    ([0], [8], r"block_ids\[0\] = 8 is outside the pool's \[0, 8\)"),
])
async def test_a_pull_that_cannot_fit_is_refused_naming_the_field(source, target, message):
    transfer, _ = _transfer()
    with pytest.raises(InvalidArgumentError, match=message):
        await transfer.pull("127.0.0.1:1", source, target)


async def test_requests_longer_than_the_pool_are_refused_before_any_read():
    # Four million ids of block 0 would hold the worker thread (and every step) for seconds.
    transfer, _ = _transfer()
    with pytest.raises(InvalidArgumentError, match="block_ids has 9 entries; at most the pool's 8 blocks"):
        [chunk async for chunk in transfer.read(LAYOUT, [0] * 9)]
    with pytest.raises(InvalidArgumentError, match="block_ids has 9 entries; at most the pool's 8 blocks"):
        await transfer.pull("127.0.0.1:1", list(range(9)), list(range(9)))
    with pytest.raises(InvalidArgumentError, match="source_address must be 1 to 256 printable characters"):
        await transfer.pull("h" * 300 + ":1", [0], [0])


class _EmptySource(executor_pb2_grpc.ExecutorServicer):
    """A source that answers every read with no blocks (a hostile or broken peer)."""

    async def ReadKVBlocks(self, request, context):
        return
        yield


async def test_kept_channels_are_bounded():
    # A pull per made-up source must not keep a channel each for ever.
    sources = []
    for _ in range(kv_transfer.MAX_KEPT_CHANNELS + 3):
        def register(server, servicer=_EmptySource()):
            executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
            return ["tokenmill.v1.Executor"]
        sources.append(await start_server("executor", register, port=0))
    transfer, _ = _transfer()
    try:
        for source in sources:
            with pytest.raises(UnavailableError, match="sent 0 of 1 blocks"):
                await transfer.pull(source.address, [0], [0])
        assert len(transfer._channels) == kv_transfer.MAX_KEPT_CHANNELS
        assert list(transfer._channels)[-1] == sources[-1].address
    finally:
        for source in sources:
            await source.stop(grace=0)
