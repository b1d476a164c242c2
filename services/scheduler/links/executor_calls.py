"""The unary calls an executor answers beside its Step stream: KV hand-offs between executors,
adapters, and grammars prepared ahead of a step.

They ride the link's channel (``BackendChannel``); the link exposes them as its own, since the
engine core's ports (KVReceiverPort) and the Admin API call them on the executor's link.
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from services.common.adapters import AdapterInfo
from services.common.codec.step_codec import adapter_from_proto
from services.common.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc
from services.scheduler.engine.ports import KVTransfer
from services.scheduler.links.backend_channel import BackendChannel

_log = structlog.get_logger("tokenmill.scheduler")

PULL_TIMEOUT_S = 60.0
REVOKE_TIMEOUT_S = 5.0
ADAPTER_TIMEOUT_S = 120.0
"""How long a LoadAdapter may take: the executor reads and checks the adapter's files (a large
adapter is hundreds of megabytes)."""
PREPARE_TIMEOUT_S = 10.0
"""How long admission waits for an executor to build a grammar's first mask (bounded by the
parser limits: milliseconds)."""


async def unary(backend: BackendChannel, failed: str, call):
    """``call(stub)``'s reply; UnavailableError when it fails, and when the link's channel is
    closed under it (a lost executor's reconnect closes it): grpc.aio then cancels the call,
    which reaches the awaiting task as a CancelledError that no one asked of it, and a hand-off
    that took it for its own cancellation would drop its request."""
    stub = executor_pb2_grpc.ExecutorStub(backend.required())
    try:
        return await call(stub)
    except grpc.RpcError as exc:
        raise UnavailableError(f"executor at {backend.address} {failed}: {exc.code().name}: {exc.details()}") from None
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the caller's own cancellation
        raise UnavailableError(f"executor at {backend.address} {failed}: its channel closed") from None


class ExecutorKV:
    """KV blocks copied between executors: a grant on the source, a pull by the target."""

    def __init__(self, backend: BackendChannel) -> None:
        self.backend = backend

    async def grant_kv(self, block_ids: list[int]) -> str:
        """Let one read of another executor copy these blocks from this one (GrantKVBlocks): the grant."""
        reply = await unary(self.backend, "granted no KV read", lambda stub: stub.GrantKVBlocks(
            executor_pb2.GrantKVBlocksRequest(block_ids=block_ids), timeout=PULL_TIMEOUT_S,
            metadata=self.backend.metadata))
        return reply.grant

    async def revoke_kv(self, grant: str) -> None:
        """End a grant (RevokeKVBlocks); raises UnavailableError when the executor did not answer."""
        await unary(self.backend, "did not revoke a KV grant", lambda stub: stub.RevokeKVBlocks(
            executor_pb2.RevokeKVBlocksRequest(grant=grant), timeout=REVOKE_TIMEOUT_S, metadata=self.backend.metadata))

    async def pull_kv(self, source: str, grant: str, source_block_ids: list[int], block_ids: list[int]) -> KVTransfer:
        """Have this executor copy KV blocks from the executor at ``source`` (PullKVBlocks),
        presenting the source's ``grant`` for them."""
        request = executor_pb2.PullKVBlocksRequest(source_address=source, source_block_ids=source_block_ids,
                                                   block_ids=block_ids, grant=grant)
        reply = await unary(self.backend, f"could not copy KV from {source}", lambda stub: stub.PullKVBlocks(
            request, timeout=PULL_TIMEOUT_S, metadata=self.backend.metadata))
        return KVTransfer(reply.num_blocks, reply.num_bytes, reply.seconds)


class ExecutorAdmin:
    """Adapters loaded and unloaded while serving, and grammars prepared ahead of a step."""

    def __init__(self, backend: BackendChannel) -> None:
        self.backend = backend

    async def prepare_grammar(self, grammar: str) -> str:
        """Have the executor build ``grammar``'s matcher and first mask ahead of any step
        (PrepareGrammar): "" when ready, else why it cannot run there. An executor that cannot
        be asked answers ""; it then builds the grammar in the step, as before."""
        if self.backend.channel is None:
            return ""
        stub = executor_pb2_grpc.ExecutorStub(self.backend.channel)
        try:
            reply = await stub.PrepareGrammar(executor_pb2.PrepareGrammarRequest(grammar=grammar),
                                              timeout=PREPARE_TIMEOUT_S, metadata=self.backend.metadata)
        except grpc.RpcError as exc:
            _log.warning("prepare_grammar_failed", executor=self.backend.address, code=exc.code().name)
            return ""
        return reply.error

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Have the executor serve the adapter at ``path`` under ``name`` (LoadAdapter);
        InvalidArgumentError with the executor's reason (file and field) when it cannot."""
        address = self.backend.address
        stub = executor_pb2_grpc.ExecutorStub(self.backend.required())
        try:
            reply = await stub.LoadAdapter(executor_pb2.LoadAdapterRequest(name=name, path=path),
                                           timeout=ADAPTER_TIMEOUT_S, metadata=self.backend.metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgumentError(exc.details()) from None
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # its --lora-dir is unset
                raise FailedPreconditionError(f"executor at {address}: {exc.details()}") from None
            raise UnavailableError(f"executor at {address} did not load adapter {name!r}: "
                                   f"{exc.code().name}: {exc.details()}") from None
        return adapter_from_proto(reply)

    async def unload_adapter(self, name: str) -> bool:
        """Have the executor forget an adapter (UnloadAdapter): whether it had it."""
        reply = await unary(self.backend, f"did not unload adapter {name!r}", lambda stub: stub.UnloadAdapter(
            executor_pb2.UnloadAdapterRequest(name=name), timeout=ADAPTER_TIMEOUT_S, metadata=self.backend.metadata))
        return reply.found
