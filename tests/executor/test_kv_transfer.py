"""The executor's side of KV copies (services/executor/kv_transfer.py): the reader refuses a
pool of another layout, ids outside the pool and ill-matched requests are refused naming the
field, and reads come in chunks that cover the blocks in order. Reads serve only the blocks of
a live grant, once; pulls connect to the configured peers alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
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


PEER = "127.0.0.1:1"


def _transfer(num_blocks: int = 8, peers=(PEER,), clock=lambda: 0.0) -> tuple[KVTransfer, KVCache]:
    cache = KVCache.allocate(CONFIG, num_blocks, 16, torch.float32, torch.device("cpu"))
    for k, v in cache.layers:
        k.normal_()
        v.normal_()
    return KVTransfer(cache, LAYOUT, bytes_per_block(CONFIG, 16, torch.float32), num_blocks, _now, peers=peers,
                      clock=clock), cache


async def test_reads_come_in_chunks_covering_the_blocks_in_order(monkeypatch):
    monkeypatch.setattr(kv_transfer, "CHUNK_BYTES", 2 * bytes_per_block(CONFIG, 16, torch.float32))
    transfer, cache = _transfer()
    chunks = [chunk async for chunk in transfer.read(LAYOUT, [7, 1, 4, 0, 2], transfer.grant([0, 1, 2, 4, 7]))]
    assert [(first, count) for first, count, _ in chunks] == [(0, 2), (2, 2), (4, 1)]
    assert [layers for _, _, layers in chunks][1] == read_blocks(cache, [4, 0])


async def test_a_reader_of_another_layout_is_refused():
    transfer, _ = _transfer()
    other = kv_layout(CONFIG, 32, torch.float32, torch.float32)
    with pytest.raises(FailedPreconditionError, match="is not this executor's"):
        [chunk async for chunk in transfer.read(other, [0], transfer.grant([0]))]


@pytest.mark.parametrize(("source", "target", "message"), [
    ([0, 1], [2], "source_block_ids has 2 entries and block_ids 1"),
    ([0, 1], [3, 3], "block_ids names a block more than once"),
    ([0], [8], r"block_ids\[0\] = 8 is outside the pool's \[0, 8\)"),
])
async def test_a_pull_that_cannot_fit_is_refused_naming_the_field(source, target, message):
    transfer, _ = _transfer()
    with pytest.raises(InvalidArgumentError, match=message):
        await transfer.pull(PEER, source, target)


async def test_requests_longer_than_the_pool_are_refused_before_any_read():
    # Four million ids of block 0 would hold the worker thread (and every step) for seconds.
    transfer, _ = _transfer()
    with pytest.raises(InvalidArgumentError, match="block_ids has 9 entries; at most the pool's 8 blocks"):
        [chunk async for chunk in transfer.read(LAYOUT, [0] * 9)]
    with pytest.raises(InvalidArgumentError, match="block_ids has 9 entries; at most the pool's 8 blocks"):
        await transfer.pull(PEER, list(range(9)), list(range(9)))
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
    transfer, _ = _transfer(peers=[source.address for source in sources])
    try:
        for source in sources:
            with pytest.raises(UnavailableError, match="sent 0 of 1 blocks"):
                await transfer.pull(source.address, [0], [0])
        assert len(transfer._channels) == kv_transfer.MAX_KEPT_CHANNELS
        assert list(transfer._channels)[-1] == sources[-1].address
    finally:
        for source in sources:
            await source.stop(grace=0)


async def test_reads_serve_only_the_blocks_of_a_live_grant_once() -> None:
    now = [0.0]
    transfer, _ = _transfer(clock=lambda: now[0])

    async def read(block_ids, grant):
        return [count async for _, count, _ in transfer.read(LAYOUT, block_ids, grant)]

    for grant in ("", "made-up", transfer.grant([1, 2])):
        with pytest.raises(PermissionDeniedError, match="no live grant of this executor names them"):
            await read([1, 2, 3], grant)  # none, unknown, or one that does not name block 3
    grant = transfer.grant([1, 2, 3])
    assert await read([3, 1], grant) == [2]
    with pytest.raises(PermissionDeniedError):
        await read([3, 1], grant)  # spent by the read that presented it
    revoked, ended, expired = transfer.grant([0]), transfer.grant([0]), transfer.grant([0])
    transfer.revoke(revoked)
    with pytest.raises(PermissionDeniedError):
        await read([0], revoked)
    now[0] = kv_transfer.GRANT_TTL_S
    with pytest.raises(PermissionDeniedError):
        await read([0], expired)
    transfer.revoke_all()
    assert transfer.num_grants == 0
    with pytest.raises(PermissionDeniedError):
        await read([0], ended)


async def test_live_grants_are_bounded_and_expired_ones_make_room(monkeypatch) -> None:
    monkeypatch.setattr(kv_transfer, "MAX_GRANTS", 3)
    now = [0.0]
    transfer, _ = _transfer(clock=lambda: now[0])
    for _ in range(3):
        transfer.grant([0])
    with pytest.raises(ResourceExhaustedError, match="3 KV grants are live"):
        transfer.grant([0])
    with pytest.raises(InvalidArgumentError, match=r"block_ids\[0\] = 8 is outside"):
        transfer.grant([8])
    now[0] = kv_transfer.GRANT_TTL_S
    assert transfer.grant([0]) and transfer.num_grants == 1


async def test_a_pull_from_an_address_outside_the_peers_connects_nowhere() -> None:
    connections = []
    listener = await asyncio.start_server(lambda reader, writer: connections.append(writer), "127.0.0.1", 0)
    address = f"127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    transfer, _ = _transfer(peers=("127.0.0.1:2",))
    try:
        with pytest.raises(PermissionDeniedError, match="is not one of this executor's --kv-peers"):
            await transfer.pull(address, [0], [0], "a-grant")
        await asyncio.sleep(0.2)
        assert connections == [] and transfer._channels == {}
    finally:
        listener.close()
