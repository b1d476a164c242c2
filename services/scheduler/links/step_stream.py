"""One Step call to an executor: a session of plans written in order and answered in order.

``send`` and ``receive`` split a step so that the next plan can be sent before the previous
result is read (overlapped scheduling). While nothing is written for ``STEP_HEARTBEAT_S`` an
empty step tells the executor the session is alive; its answer is read in its turn among the
others and dropped. The call is watched, so its end between steps (the executor died while the
scheduler was idle) is reported at once, not when the next step needs it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import grpc
import grpc.aio

from services.common.codec.step_codec import plan_to_proto, result_from_proto
from services.common.errors import InvalidArgumentError, UnavailableError
from services.common.step import StepPlan, StepResult
from services.scheduler.links.channel import ended

HANDSHAKE_STEP_ID = 2**64 - 1
"""An empty step sent when a session opens (and as a heartbeat); scheduler step ids count up from 0."""
STEP_HEARTBEAT_S = 10.0
"""With nothing written for this long, an empty step tells the executor the session is alive:
it ends sessions that go silent (its step_idle_timeout_s, at least three heartbeats)."""


class _Answers:
    """The answers awaited on one call, in the order their plans were written: a plan's step id,
    or a heartbeat's marker (its empty answer is read and dropped). One reader at a time."""

    def __init__(self, call) -> None:
        self.call = call
        self.places: deque = deque()
        self.lock = asyncio.Lock()

    async def read_beat(self, beat: object) -> None:
        """A heartbeat's answer, read now when no plan was sent behind it (else ``skip_beats``
        reads it in its turn)."""
        async with self.lock:
            if self.places and self.places[0] is beat:
                self.places.popleft()
                await self.call.read()

    async def skip_beats(self, address: str, step_id: int) -> None:
        """Under ``lock``: read the heartbeats' answers ahead of the oldest plan's, and take its place."""
        while True:
            if not self.places:
                raise UnavailableError(f"executor at {address}: no step {step_id} was sent on this session")
            if isinstance(self.places.popleft(), int):
                return
            try:
                await self.call.read()  # a heartbeat's empty answer, ahead of this step's
            except (grpc.RpcError, asyncio.InvalidStateError):
                pass  # the step's own read reports how the stream ended


class StepStream:
    """One session's call: plans written in order, their answers read in the same order."""

    def __init__(self, call, address: str, on_end: Callable[[StepStream], None]) -> None:
        self.call = call
        self.address = address
        self.live = True
        """False once a step failed on the call, it ended, or it was cancelled: no plan goes on it."""
        self.on_end = on_end
        """Told once when the call ends with no step failing on it (``watch``)."""
        self.last_write = 0.0
        self._answers = _Answers(call)
        self._write_lock = asyncio.Lock()  # a heartbeat may write while the engine is idle
        self._tasks: list[asyncio.Task] = []

    def watch(self) -> None:
        """Once the session is confirmed: report its end, and beat while it is idle."""
        self._tasks = [asyncio.create_task(_report_end(self), name="executor-session-watch"),
                       asyncio.create_task(_heartbeats(self), name="executor-session-heartbeat")]

    async def beat(self) -> None:
        """One empty step, to tell the executor the session is alive."""
        beat = object()
        self._answers.places.append(beat)
        async with self._write_lock:
            await self.call.write(plan_to_proto(StepPlan(step_id=HANDSHAKE_STEP_ID)))
        self.last_write = asyncio.get_running_loop().time()
        await self._answers.read_beat(beat)

    async def send(self, plan: StepPlan) -> None:
        """Write one plan; its result comes from ``receive``, after those of earlier plans."""
        self._answers.places.append(plan.step_id)
        try:
            async with self._write_lock:
                await self.call.write(plan_to_proto(plan))
            self.last_write = asyncio.get_running_loop().time()
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            self.live = False
            raise UnavailableError(f"executor at {self.address} failed: {await ended(self.call, exc)}") from None

    async def receive(self, step_id: int) -> StepResult:
        """The result of the oldest plan sent and not yet received (``step_id``'s); readable even
        once the call has ended (the answer says how)."""
        async with self._answers.lock:
            await self._answers.skip_beats(self.address, step_id)
            try:
                return await _read_result(self.call, self.address, step_id)
            except Exception:
                self.live = False
                raise

    def cancel(self) -> None:
        self.live = False
        self._answers.places.clear()
        self.call.cancel()
        for task in self._tasks:
            task.cancel()


async def _report_end(stream: StepStream) -> None:
    await stream.call.code()  # returns when the call ends, whoever ends it
    if stream.live:
        stream.live = False
        stream.on_end(stream)


async def _heartbeats(stream: StepStream) -> None:
    """An empty step whenever nothing was written for STEP_HEARTBEAT_S."""
    loop = asyncio.get_running_loop()
    while stream.live:
        await asyncio.sleep(STEP_HEARTBEAT_S)
        if not stream.live or loop.time() - stream.last_write < STEP_HEARTBEAT_S:
            continue
        try:
            await stream.beat()
        except (grpc.RpcError, asyncio.InvalidStateError):
            return  # the watcher reports the end


async def _read_result(call, address: str, step_id: int) -> StepResult:
    """The next answer on ``call``, as step ``step_id``'s result; the error a step's caller hears
    when the stream broke or ended instead (INVALID_ARGUMENT: the executor refused the plan)."""
    try:
        response = await call.read()
    except (grpc.RpcError, asyncio.InvalidStateError) as exc:
        raise UnavailableError(f"executor at {address} failed: {await ended(call, exc)}") from None
    if response is grpc.aio.EOF:
        code, details = await call.code(), await call.details()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidArgumentError(f"executor rejected step {step_id}: {details}")
        raise UnavailableError(f"executor at {address} ended the step stream: {code.name}: {details}")
    return result_from_proto(response)
