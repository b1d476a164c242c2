"""The executor's side of KV copies between executors (disaggregated prefill).

A decode executor pulls a prompt's blocks from the prefill executor that computed them:
``pull`` opens a ReadKVBlocks stream to it, asking with its own pool layout (kv_layout:
model, geometry, storage dtype), and writes each chunk into the blocks the scheduler chose;
``read`` answers such a stream, refusing a layout that is not its own. Both touch the pool on
the runner's one worker thread, so a copy interleaves with steps but never races one: the
scheduler only names blocks no step of either executor uses meanwhile (the prefill side
holds them until the copy is acknowledged, the decode side has not handed them to a
sequence yet).

Both are bounded before any work: no more block ids than the pool has (a ReadKVBlocks naming
one block four million times would hold the worker thread, and every step behind it, for
seconds), a source address of a sane length, and a few kept channels (one per source executor;
an address per call must not grow them for ever). Who may call either is the port's business:
PullKVBlocks the scheduler alone, ReadKVBlocks the other executors too
(``--tls-allowed-clients``, ``--tls-peer-clients``; services/common/peer_identity.py; or the
deployment's internal secret, services/common/internal_secret.py).

Holding the right credentials is not enough to read or write a pool:

- ``read`` serves only blocks a grant names. The scheduler grants a hand-off's blocks on the
  source (``grant``: an unguessable token, passed to the decode executor inside PullKVBlocks and
  presented by it); the read that presents a grant spends it, the scheduler revokes it when the
  hand-off ends, it expires after GRANT_TTL_S, and every grant ends with the Step session (a new
  scheduler's block ids mean other prompts). Without that any caller could read another tenant's
  prompt back out of the pool.
- ``pull`` connects only to the configured peers (``--kv-peers``): an address from the request
  is matched against them before anything connects, so PullKVBlocks cannot make the executor
  reach a host its caller chose (and write what that host sends into the pool).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

import grpc

from services.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
from services.common.internal_secret import call_metadata
from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc
from services.common.server import channel_options, create_channel
from services.common.tls import ClientTLS
from services.runtime.kv_blocks import read_blocks, write_blocks
from services.runtime.kv_cache import KVCache

CHUNK_BYTES = 4 * 1024 * 1024
"""About how much one KVBlockChunk carries (at least one block): well under the message limit."""
READ_TIMEOUT_S = 60.0
MAX_SOURCE_ADDRESS_CHARS = 256
MAX_KEPT_CHANNELS = 8
"""Source executors whose channels are kept open; the least recently used one is closed beyond."""
GRANT_TTL_S = 120.0
"""A grant not spent or revoked by then expires (the scheduler abandons a copy after 30 s)."""
MAX_GRANTS = 4096
"""Live grants at once; one per hand-off in flight, far fewer than this."""


@dataclass(frozen=True, slots=True)
class PullReport:
    num_blocks: int
    num_bytes: int
    seconds: float


def _check_ids(field: str, block_ids: Sequence[int], num_blocks: int) -> None:
    if len(block_ids) > num_blocks:
        raise InvalidArgumentError(f"{field} has {len(block_ids)} entries; at most the pool's {num_blocks} blocks")
    for index, block_id in enumerate(block_ids):
        if not 0 <= block_id < num_blocks:
            raise InvalidArgumentError(f"{field}[{index}] = {block_id} is outside the pool's [0, {num_blocks})")


class KVTransfer:
    """``on_worker(fn, *args)`` runs fn on the runner's worker thread and awaits it."""

    def __init__(self, cache: KVCache, layout: str, block_bytes: int, num_blocks: int,
                 on_worker: Callable[..., Awaitable], tls: ClientTLS | None = None, secret: str = "",
                 peers: Collection[str] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self._cache = cache
        self.layout = layout
        self._num_blocks = num_blocks
        self._blocks_per_chunk = max(1, CHUNK_BYTES // block_bytes)
        self._on_worker = on_worker
        self._tls = tls
        self._metadata = call_metadata(secret)
        """The deployment's internal secret, which the source requires (internal_secret.py)."""
        self._channels: dict[str, grpc.aio.Channel] = {}
        """One channel per source executor, kept: a copy is on the path of a request's second token."""
        self._peers = frozenset(peers)
        """The only addresses ``pull`` connects to (--kv-peers)."""
        self._grants: dict[str, tuple[frozenset[int], float]] = {}
        """Live grants: token -> (the blocks it names, when it expires)."""
        self._clock = clock

    def grant(self, block_ids: Sequence[int]) -> str:
        """A token that lets one ``read`` read ``block_ids`` (GrantKVBlocks)."""
        _check_ids("block_ids", block_ids, self._num_blocks)
        now = self._clock()
        for token in [t for t, (_, expires) in self._grants.items() if expires <= now]:
            del self._grants[token]
        if len(self._grants) >= MAX_GRANTS:
            raise ResourceExhaustedError(f"{MAX_GRANTS} KV grants are live; revoke some (RevokeKVBlocks)")
        token = secrets.token_urlsafe(24)
        self._grants[token] = (frozenset(block_ids), now + GRANT_TTL_S)
        return token

    def revoke(self, grant: str) -> None:
        """End one grant (RevokeKVBlocks); one already spent or unknown is no error."""
        self._grants.pop(grant, None)

    def revoke_all(self) -> None:
        """End every grant: the Step session that made them ended."""
        self._grants.clear()

    @property
    def num_grants(self) -> int:
        return len(self._grants)

    async def read(self, layout: str, block_ids: Sequence[int],
                   grant: str = "") -> AsyncIterator[tuple[int, int, list[bytes]]]:
        """(first, count, layers) chunks of ``block_ids`` for a reader whose pool has ``layout``,
        when ``grant`` names them all (the grant is spent)."""
        _check_ids("block_ids", block_ids, self._num_blocks)
        granted, expires = self._grants.pop(grant, (frozenset(), 0.0))
        if expires <= self._clock() or not granted.issuperset(block_ids):
            raise PermissionDeniedError("ReadKVBlocks reads only the blocks of a hand-off in flight: no live grant of "
                                        "this executor names them (the scheduler grants them; GrantKVBlocks)")
        if layout != self.layout:
            raise FailedPreconditionError(f"the reader's KV layout {layout[:200]!r} is not this executor's "
                                          f"{self.layout!r}")
        step = self._blocks_per_chunk
        for first in range(0, len(block_ids), step):
            ids = list(block_ids[first:first + step])
            yield first, len(ids), await self._on_worker(read_blocks, self._cache, ids)

    async def pull(self, source_address: str, source_block_ids: Sequence[int],
                   block_ids: Sequence[int], grant: str = "") -> PullReport:
        """Copy ``source_block_ids`` of the executor at ``source_address`` (one of the peers) into
        ``block_ids``, presenting the source's ``grant`` for them."""
        if not 0 < len(source_address) <= MAX_SOURCE_ADDRESS_CHARS or not source_address.isprintable():
            raise InvalidArgumentError(f"source_address must be 1 to {MAX_SOURCE_ADDRESS_CHARS} printable "
                                       "characters (host:port)")
        if source_address not in self._peers:
            raise PermissionDeniedError(f"source_address {source_address!r} is not one of this executor's --kv-peers: "
                                        "it pulls KV blocks from its configured peers alone")
        _check_ids("block_ids", block_ids, self._num_blocks)
        if len(source_block_ids) != len(block_ids):
            raise InvalidArgumentError(f"source_block_ids has {len(source_block_ids)} entries and block_ids "
                                       f"{len(block_ids)}: one target block per source block")
        if len(set(block_ids)) != len(block_ids):
            raise InvalidArgumentError("block_ids names a block more than once")
        started = time.perf_counter()
        num_bytes = copied = 0
        channel = self._channels.pop(source_address, None)  # re-inserted: the newest
        if channel is None:
            channel = create_channel(source_address, tls=self._tls, options=channel_options())
        self._channels[source_address] = channel
        while len(self._channels) > MAX_KEPT_CHANNELS:
            await self._channels.pop(next(iter(self._channels))).close()
        stub = executor_pb2_grpc.ExecutorStub(channel)
        request = executor_pb2.ReadKVBlocksRequest(kv_layout=self.layout, block_ids=list(source_block_ids),
                                                   grant=grant)
        try:
            async for chunk in stub.ReadKVBlocks(request, timeout=READ_TIMEOUT_S, metadata=self._metadata):
                if chunk.first != copied or chunk.count < 1 or copied + chunk.count > len(block_ids):
                    raise InvalidArgumentError(f"the source sent blocks [{chunk.first}, "
                                               f"{chunk.first + chunk.count}) after {copied}")
                targets = list(block_ids[chunk.first:chunk.first + chunk.count])
                try:
                    await self._on_worker(write_blocks, self._cache, targets, list(chunk.layers))
                except ValueError as exc:
                    raise InvalidArgumentError(f"the source's blocks do not fit this pool: {exc}") from None
                copied += chunk.count
                num_bytes += sum(len(layer) for layer in chunk.layers)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise FailedPreconditionError(exc.details()) from None
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise PermissionDeniedError(f"the source at {source_address} refused the read: "
                                            f"{exc.details()}") from None
            stale = self._channels.pop(source_address, None)
            if stale is not None:
                await stale.close()  # a restarted source is reached afresh
            raise UnavailableError(f"reading KV blocks from {source_address} failed: "
                                   f"{exc.code().name}: {exc.details()}") from None
        if copied != len(block_ids):
            raise UnavailableError(f"the source at {source_address} sent {copied} of {len(block_ids)} blocks")
        return PullReport(copied, num_bytes, time.perf_counter() - started)
