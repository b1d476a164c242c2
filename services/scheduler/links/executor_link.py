"""The scheduler's link to its executor: one long-lived Step stream, one message per step.

The engine core's ExecutorPort over gRPC. Failures surface as UnavailableError (or
InvalidArgumentError when the executor refused a step), which the engine core turns into one
Finished (error) per request on it. With ``tls`` the link connects over TLS (mTLS with a
client certificate), its files read when the channel is made.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import grpc
import grpc.aio
import structlog

from services.common.adapters import AdapterInfo
from services.common.codec.step_codec import (
    adapter_from_proto, executor_info_from_proto, plan_to_proto, result_from_proto)
from services.common.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc
from services.common.internal_secret import call_metadata
from services.common.server import create_channel
from services.common.step import ExecutorInfo, StepPlan, StepResult
from services.common.tls import ClientTLS
from services.scheduler.engine.ports import KVTransfer
from services.scheduler.links.channel import BACKEND_CHANNEL_OPTIONS, ended, wait_ready

_log = structlog.get_logger("tokenmill.scheduler")

PULL_TIMEOUT_S = 60.0
REVOKE_TIMEOUT_S = 5.0
ADAPTER_TIMEOUT_S = 120.0
"""How long a LoadAdapter may take: the executor reads and checks the adapter's files (a large
adapter is hundreds of megabytes)."""
PREPARE_TIMEOUT_S = 10.0
"""How long admission waits for an executor to build a grammar's first mask (bounded by the
parser limits: milliseconds)."""
HANDSHAKE_STEP_ID = 2**64 - 1
"""An empty step sent when a session opens (and as a heartbeat); scheduler step ids count up from 0."""
STEP_HEARTBEAT_S = 10.0
"""With nothing written for this long, an empty step tells the executor the session is alive:
it ends sessions that go silent (its step_idle_timeout_s, at least three heartbeats)."""


class _Beat:
    """A heartbeat in the order of answers: its empty answer is read and dropped."""

    __slots__ = ("call",)

    def __init__(self, call) -> None:
        self.call = call


class ExecutorLink:
    """One Step stream to the executor. The stream is a session: reconnecting starts clean.

    A session that ends between steps (the executor died while the scheduler was idle) is
    noticed at once: the link drops the call and calls ``on_lost``, so the owner reconnects
    before a request is sent into a dead stream.

    ``send`` and ``receive`` split a step so that the next plan can be sent before the
    previous result is read (overlapped scheduling): the executor answers in order, one
    result per plan; ``step`` is the two together.
    """

    def __init__(self, address: str, tls: ClientTLS | None = None, on_lost: Callable[[], None] = lambda: None,
                 secret: str = "") -> None:
        self.address = address
        self.tls = tls
        self._metadata = call_metadata(secret)
        """The deployment's internal secret, sent on every call (services/common/internal_secret.py)."""
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._awaiting: deque = deque()
        """The call each sent plan was written to, oldest first: its result is read there even
        if the watcher has dropped the call meanwhile (to report how the stream ended)."""
        self._watcher: asyncio.Task | None = None
        self._beating: asyncio.Task | None = None
        self._last_write = 0.0
        # A heartbeat may write and read while the engine is idle: one writer and one reader at
        # a time on the call (uncontended, neither lock waits).
        self._write_lock = asyncio.Lock()
        self._read_lock = asyncio.Lock()
        self.info: ExecutorInfo | None = None
        self._on_lost = on_lost
        """Called when a confirmed session ends without a step failing on it."""

    @property
    def connected(self) -> bool:
        return self._call is not None

    async def connect(self, timeout: float) -> ExecutorInfo:
        await self.close()
        self._channel = create_channel(self.address, tls=self.tls, options=BACKEND_CHANNEL_OPTIONS)
        deadline = asyncio.get_running_loop().time() + timeout
        await wait_ready(self._channel, self.address, timeout)
        stub = executor_pb2_grpc.ExecutorStub(self._channel)
        while True:
            try:
                self.info = executor_info_from_proto(await stub.GetExecutorInfo(
                    executor_pb2.GetExecutorInfoRequest(), timeout=timeout, metadata=self._metadata))
                break
            except grpc.RpcError as exc:
                # UNAVAILABLE while it still loads its model (it binds its port first): wait for it.
                if exc.code() != grpc.StatusCode.UNAVAILABLE or asyncio.get_running_loop().time() > deadline:
                    raise UnavailableError(f"executor at {self.address}: {exc.code().name}: {exc.details()}") from None
                await asyncio.sleep(0.2)
        # The executor notices a previous session's end asynchronously and refuses a second
        # concurrent session (FAILED_PRECONDITION); an empty step confirms this one is live.
        while True:
            self._call = stub.Step(metadata=self._metadata)
            self._awaiting.clear()  # a failed attempt's handshake
            try:
                await self.step(StepPlan(step_id=HANDSHAKE_STEP_ID))
                self._watcher = asyncio.create_task(self._watch(self._call), name="executor-session-watch")
                self._beating = asyncio.create_task(self._beat(self._call), name="executor-session-heartbeat")
                return self.info
            except UnavailableError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def _watch(self, call) -> None:
        await call.code()  # returns when the call ends, whoever ends it
        if self._call is call:  # not closed by us, and no step has failed on it yet
            self._call = None
            self._on_lost()

    async def _beat(self, call) -> None:
        """An empty step whenever nothing was written for STEP_HEARTBEAT_S; read here when no
        plan was sent behind it, else by ``receive`` in its turn."""
        loop = asyncio.get_running_loop()
        while self._call is call:
            await asyncio.sleep(STEP_HEARTBEAT_S)
            if self._call is not call or loop.time() - self._last_write < STEP_HEARTBEAT_S:
                continue
            beat = _Beat(call)
            self._awaiting.append(beat)
            try:
                async with self._write_lock:
                    await call.write(plan_to_proto(StepPlan(step_id=HANDSHAKE_STEP_ID)))
                self._last_write = loop.time()
                async with self._read_lock:
                    if self._awaiting and self._awaiting[0] is beat:
                        self._awaiting.popleft()
                        await call.read()
            except (grpc.RpcError, asyncio.InvalidStateError):
                return  # the watcher reports the end

    async def step(self, plan: StepPlan) -> StepResult:
        await self.send(plan)
        return await self.receive(plan.step_id)

    async def send(self, plan: StepPlan) -> None:
        """Write one plan; its result comes from ``receive``, after those of earlier plans."""
        call = self._call
        if call is None:
            raise UnavailableError(f"executor at {self.address} is not connected")
        self._awaiting.append(call)
        try:
            async with self._write_lock:
                await call.write(plan_to_proto(plan))
            self._last_write = asyncio.get_running_loop().time()
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            self._call = None
            raise UnavailableError(f"executor at {self.address} failed: {await ended(call, exc)}") from None

    async def receive(self, step_id: int) -> StepResult:
        """Read the result of the oldest plan sent and not yet received (``step_id``'s)."""
        async with self._read_lock:
            return await self._receive(step_id)

    async def _receive(self, step_id: int) -> StepResult:
        while True:
            if not self._awaiting:
                raise UnavailableError(f"executor at {self.address}: no step {step_id} was sent on this session")
            call = self._awaiting.popleft()  # the watcher may drop self._call while this step awaits
            if not isinstance(call, _Beat):
                break
            try:
                await call.call.read()  # a heartbeat's empty answer, ahead of this step's
            except (grpc.RpcError, asyncio.InvalidStateError):
                pass  # the step's own read below reports how the stream ended
        try:
            response = await call.read()
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            self._call = None
            raise UnavailableError(f"executor at {self.address} failed: {await ended(call, exc)}") from None
        if response is grpc.aio.EOF:
            code = await call.code()
            details = await call.details()
            self._call = None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgumentError(f"executor rejected step {step_id}: {details}")
            raise UnavailableError(f"executor at {self.address} ended the step stream: {code.name}: {details}")
        return result_from_proto(response)

    async def grant_kv(self, block_ids: list[int]) -> str:
        """Let one read of another executor copy these blocks from this one (GrantKVBlocks): the grant."""
        reply = await self._unary("granted no KV read", lambda stub: stub.GrantKVBlocks(
            executor_pb2.GrantKVBlocksRequest(block_ids=block_ids), timeout=PULL_TIMEOUT_S, metadata=self._metadata))
        return reply.grant

    async def revoke_kv(self, grant: str) -> None:
        """End a grant (RevokeKVBlocks); raises UnavailableError when the executor did not answer."""
        await self._unary("did not revoke a KV grant", lambda stub: stub.RevokeKVBlocks(
            executor_pb2.RevokeKVBlocksRequest(grant=grant), timeout=REVOKE_TIMEOUT_S, metadata=self._metadata))

    async def pull_kv(self, source: str, grant: str, source_block_ids: list[int], block_ids: list[int]) -> KVTransfer:
        """Have this executor copy KV blocks from the executor at ``source`` (PullKVBlocks),
        presenting the source's ``grant`` for them."""
        request = executor_pb2.PullKVBlocksRequest(source_address=source, source_block_ids=source_block_ids,
                                                   block_ids=block_ids, grant=grant)
        reply = await self._unary(f"could not copy KV from {source}", lambda stub: stub.PullKVBlocks(
            request, timeout=PULL_TIMEOUT_S, metadata=self._metadata))
        return KVTransfer(reply.num_blocks, reply.num_bytes, reply.seconds)

    async def _unary(self, failed: str, call):
        """``call(stub)``'s reply; UnavailableError when it fails, and when the link's channel is
        closed under it (a lost executor's reconnect closes it): grpc.aio then cancels the call,
        which reaches the awaiting task as a CancelledError that no one asked of it, and a hand-off
        that took it for its own cancellation would drop its request."""
        if self._channel is None:
            raise UnavailableError(f"executor at {self.address} is not connected")
        try:
            return await call(executor_pb2_grpc.ExecutorStub(self._channel))
        except grpc.RpcError as exc:
            raise UnavailableError(f"executor at {self.address} {failed}: {exc.code().name}: {exc.details()}") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller's own cancellation
            raise UnavailableError(f"executor at {self.address} {failed}: its channel closed") from None

    async def prepare_grammar(self, grammar: str) -> str:
        """Have the executor build ``grammar``'s matcher and first mask ahead of any step
        (PrepareGrammar): "" when ready, else why it cannot run there. An executor that cannot
        be asked answers ""; it then builds the grammar in the step, as before."""
        if self._channel is None:
            return ""
        stub = executor_pb2_grpc.ExecutorStub(self._channel)
        try:
            reply = await stub.PrepareGrammar(executor_pb2.PrepareGrammarRequest(grammar=grammar),
                                              timeout=PREPARE_TIMEOUT_S, metadata=self._metadata)
        except grpc.RpcError as exc:
            _log.warning("prepare_grammar_failed", executor=self.address, code=exc.code().name)
            return ""
        return reply.error

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Have the executor serve the adapter at ``path`` under ``name`` (LoadAdapter);
        InvalidArgumentError with the executor's reason (file and field) when it cannot."""
        if self._channel is None:
            raise UnavailableError(f"executor at {self.address} is not connected")
        stub = executor_pb2_grpc.ExecutorStub(self._channel)
        try:
            reply = await stub.LoadAdapter(executor_pb2.LoadAdapterRequest(name=name, path=path),
                                           timeout=ADAPTER_TIMEOUT_S, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgumentError(exc.details()) from None
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # its --lora-dir is unset
                raise FailedPreconditionError(f"executor at {self.address}: {exc.details()}") from None
            raise UnavailableError(f"executor at {self.address} did not load adapter {name!r}: "
                                   f"{exc.code().name}: {exc.details()}") from None
        return adapter_from_proto(reply)

    async def unload_adapter(self, name: str) -> bool:
        """Have the executor forget an adapter (UnloadAdapter): whether it had it."""
        reply = await self._unary(f"did not unload adapter {name!r}", lambda stub: stub.UnloadAdapter(
            executor_pb2.UnloadAdapterRequest(name=name), timeout=ADAPTER_TIMEOUT_S, metadata=self._metadata))
        return reply.found

    async def close(self) -> None:
        call, self._call = self._call, None  # first, so the watcher sees a closed link
        self._awaiting.clear()
        if call is not None:
            call.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._beating is not None:
            self._beating.cancel()
            self._beating = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
