"""The scheduler's link to its executor: one long-lived Step stream, one message per step.

The engine core's ExecutorPort over gRPC. Failures surface as UnavailableError (or
InvalidArgumentError when the executor refused a step), which the engine core turns into one
Finished (error) per request on it. With ``tls`` the link connects over TLS (mTLS with a
client certificate), its files read when the channel is made.

The session itself (plans and answers in order, heartbeats, its end noticed) is a StepStream
(step_stream.py); the unary calls beside it are ExecutorKV and ExecutorAdmin (executor_calls.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from services.common.codec.step_codec import executor_info_from_proto
from services.common.errors import UnavailableError
from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc
from services.common.step import ExecutorInfo, StepPlan, StepResult
from services.common.tls import ClientTLS
from services.scheduler.links.backend_channel import BackendChannel
from services.scheduler.links.executor_calls import ExecutorAdmin, ExecutorKV
from services.scheduler.links.step_stream import HANDSHAKE_STEP_ID, StepStream


class ExecutorLink:
    """One Step stream to the executor. The stream is a session: reconnecting starts clean.

    A session that ends between steps (the executor died while the scheduler was idle) is
    noticed at once: the link is down and ``on_lost`` is called, so the owner reconnects
    before a request is sent into a dead stream."""

    def __init__(self, address: str, tls: ClientTLS | None = None, on_lost: Callable[[], None] = lambda: None,
                 secret: str = "") -> None:
        self.address = address
        self.backend = BackendChannel("executor", address, tls, secret)
        self._stream: StepStream | None = None
        self.info: ExecutorInfo | None = None
        self._on_lost = on_lost
        """Called when a confirmed session ends without a step failing on it."""
        kv, admin = ExecutorKV(self.backend), ExecutorAdmin(self.backend)
        self.grant_kv, self.revoke_kv, self.pull_kv = kv.grant_kv, kv.revoke_kv, kv.pull_kv
        self.prepare_grammar, self.load_adapter = admin.prepare_grammar, admin.load_adapter
        self.unload_adapter = admin.unload_adapter

    @property
    def connected(self) -> bool:
        return self._stream is not None and self._stream.live

    async def connect(self, timeout: float) -> ExecutorInfo:
        await self.close()
        deadline = asyncio.get_running_loop().time() + timeout
        self.backend.open()
        await self.backend.ready(timeout)
        stub = executor_pb2_grpc.ExecutorStub(self.backend.channel)
        self.info = await _executor_info(stub, self.backend, timeout, deadline)
        self._stream = await _confirmed_session(stub, self.backend, lambda stream: self._on_lost(), deadline)
        self._stream.watch()
        return self.info

    async def send(self, plan: StepPlan) -> None:
        """Write one plan; its result comes from ``receive``, after those of earlier plans."""
        if not self.connected:
            raise UnavailableError(f"executor at {self.address} is not connected")
        await self._stream.send(plan)

    async def receive(self, step_id: int) -> StepResult:
        """Read the result of the oldest plan sent and not yet received (``step_id``'s), on the
        session it was sent on even once that has ended (its answer says how)."""
        if self._stream is None:
            raise UnavailableError(f"executor at {self.address}: no step {step_id} was sent on this session")
        return await self._stream.receive(step_id)

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()  # first, so its end is not reported as a loss
        await self.backend.close()


async def _executor_info(stub, backend: BackendChannel, timeout: float, deadline: float) -> ExecutorInfo:
    """GetExecutorInfo, waiting while the executor answers UNAVAILABLE: it binds its port before
    it has loaded its model."""
    while True:
        try:
            return executor_info_from_proto(await stub.GetExecutorInfo(
                executor_pb2.GetExecutorInfoRequest(), timeout=timeout, metadata=backend.metadata))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or asyncio.get_running_loop().time() > deadline:
                raise UnavailableError(f"executor at {backend.address}: {exc.code().name}: {exc.details()}") from None
            await asyncio.sleep(0.2)


async def _confirmed_session(stub, backend: BackendChannel, on_end: Callable[[StepStream], None],
                             deadline: float) -> StepStream:
    """A new Step session, confirmed by an empty step. The executor notices a previous session's
    end asynchronously and refuses a second concurrent session (FAILED_PRECONDITION) meanwhile:
    tried again until ``deadline``."""
    while True:
        stream = StepStream(stub.Step(metadata=backend.metadata), backend.address, on_end)
        try:
            await stream.send(StepPlan(step_id=HANDSHAKE_STEP_ID))
            await stream.receive(HANDSHAKE_STEP_ID)
            return stream
        except UnavailableError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)
