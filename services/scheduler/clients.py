"""The scheduler's links to the executor and the tokenizers: one long-lived stream each.

Each step is one message on each stream. Failures surface as UnavailableError, which the
scheduler loop turns into UNAVAILABLE on the affected client streams. With ``tls`` every link
connects over TLS (mTLS with a client certificate), its files read when the channel is made.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio

from services.common.codec.step_codec import executor_info_from_proto, plan_to_proto, result_from_proto
from services.common.errors import InvalidArgumentError, UnavailableError
from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.common.server import channel_options, create_channel
from services.common.step import ExecutorInfo, StepPlan, StepResult
from services.common.tls import ClientTLS

BACKEND_CHANNEL_OPTIONS = channel_options() + [
    # gRPC's default back-off after a lost connection starts at 1 s and grows to 120 s; a
    # backend the launcher restarts within a second must be found again within a few.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

HANDSHAKE_STEP_ID = 2**64 - 1
"""An empty step sent when a session opens; scheduler step ids count up from 0."""


async def run_to_end(call: grpc.aio.UnaryUnaryCall):
    """The reply of a unary call that is not cancelled with its caller.

    A Generate handler awaiting its prompt's Encode is cancelled when its client goes away (a
    cancel, a passing deadline). Cancelling the call with it would leak C memory in grpcio's
    asyncio layer (1.85): ``execute_batch`` frees a batch's ``grpc_op`` array and the request's
    byte buffer only when its awaiting coroutine resumes, so a batch whose awaiter is cancelled
    keeps ~0.6 KB of the C heap for good. Under the stress suite's load one Encode in 170 was
    cut so, the largest part of the scheduler's slow C-heap growth (heaptrack; docs/design.md,
    Hardening). The caller here gets its CancelledError at once; the call, already sent and
    bounded by its own deadline, finishes in the background and its batch is freed."""
    return await asyncio.shield(call)


async def wait_ready(channel: grpc.aio.Channel, address: str, timeout: float) -> None:
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout)
    except asyncio.TimeoutError:
        raise UnavailableError(f"{address} did not become reachable within {timeout:.0f}s") from None


class ExecutorLink:
    """One Step stream to the executor. The stream is a session: reconnecting starts clean.

    A session that ends between steps (the executor died while the scheduler was idle) is
    noticed at once: the link drops the call and calls ``on_lost``, so the owner reconnects
    before a request is sent into a dead stream.

    ``send`` and ``receive`` split a step so that the next plan can be sent before the
    previous result is read (overlapped scheduling): the executor answers in order, one
    result per plan; ``step`` is the two together.
    """

    def __init__(self, address: str, tls: ClientTLS | None = None) -> None:
        self.address = address
        self.tls = tls
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._awaiting: deque = deque()
        """The call each sent plan was written to, oldest first: its result is read there even
        if the watcher has dropped the call meanwhile (to report how the stream ended)."""
        self._watcher: asyncio.Task | None = None
        self.info: ExecutorInfo | None = None
        self.on_lost: Callable[[], None] = lambda: None
        """Called when a confirmed session ends without a step failing on it."""

    @property
    def connected(self) -> bool:
        return self._call is not None

    async def connect(self, timeout: float) -> ExecutorInfo:
        await self.close()
        self._channel = create_channel(self.address, tls=self.tls, options=BACKEND_CHANNEL_OPTIONS)
        await wait_ready(self._channel, self.address, timeout)
        stub = executor_pb2_grpc.ExecutorStub(self._channel)
        try:
            self.info = executor_info_from_proto(await stub.GetExecutorInfo(executor_pb2.GetExecutorInfoRequest(),
                                                                            timeout=timeout))
        except grpc.RpcError as exc:
            raise UnavailableError(f"executor at {self.address}: {exc.code().name}: {exc.details()}") from None
        # The executor notices a previous session's end asynchronously and refuses a second
        # concurrent session (FAILED_PRECONDITION); an empty step confirms this one is live.
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            self._call = stub.Step()
            self._awaiting.clear()  # a failed attempt's handshake
            try:
                await self.step(StepPlan(step_id=HANDSHAKE_STEP_ID))
                self._watcher = asyncio.create_task(self._watch(self._call), name="executor-session-watch")
                return self.info
            except UnavailableError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def _watch(self, call) -> None:
        await call.code()  # returns when the call ends, whoever ends it
        if self._call is call:  # not closed by us, and no step has failed on it yet
            self._call = None
            self.on_lost()

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
            await call.write(plan_to_proto(plan))
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            self._call = None
            raise UnavailableError(f"executor at {self.address} failed: {await _ended(call, exc)}") from None

    async def receive(self, step_id: int) -> StepResult:
        """Read the result of the oldest plan sent and not yet received (``step_id``'s)."""
        if not self._awaiting:
            raise UnavailableError(f"executor at {self.address}: no step {step_id} was sent on this session")
        call = self._awaiting.popleft()  # the watcher may drop self._call while this step awaits
        try:
            response = await call.read()
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            self._call = None
            raise UnavailableError(f"executor at {self.address} failed: {await _ended(call, exc)}") from None
        if response is grpc.aio.EOF:
            code = await call.code()
            details = await call.details()
            self._call = None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgumentError(f"executor rejected step {step_id}: {details}")
            raise UnavailableError(f"executor at {self.address} ended the step stream: {code.name}: {details}")
        return result_from_proto(response)

    async def close(self) -> None:
        call, self._call = self._call, None  # first, so the watcher sees a closed link
        self._awaiting.clear()
        if call is not None:
            call.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


@dataclass(slots=True)
class DetokenizeBatch:
    """One step's detokenization work for one tokenizer stream."""

    new_streams: list[tuple[int, list[int]]]
    """(stream id, prompt tail for context)"""
    appended: list[tuple[int, list[int]]]
    closed: list[int]


class TokenizerLink:
    """One tokenizer service: unary Encode/RenderChat plus one Detokenize stream.

    The Detokenize stream holds the state of every request's text, so it is a session like
    the executor's: when it ends (the tokenizer died or restarted), the link is down until
    ``connect`` opens a new one, and ``on_lost`` is called once so the owner can end the
    requests pinned to it and reconnect. The stream is watched, so a tokenizer that dies
    while the scheduler is idle is noticed at once, not when the next step needs it.
    """

    def __init__(self, address: str, tls: ClientTLS | None = None) -> None:
        self.address = address
        self.tls = tls
        self._channel = create_channel(address, tls=tls, options=BACKEND_CHANNEL_OPTIONS)
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
        self._detok = None
        self._watcher: asyncio.Task | None = None
        self._step_ids = itertools.count()
        self.on_lost: Callable[[], None] = lambda: None
        """Called once each time a connected Detokenize session ends."""

    @property
    def connected(self) -> bool:
        return self._detok is not None

    async def connect(self, timeout: float) -> tokenizer_pb2.TokenizerInfo:
        """Open a new Detokenize session (on a fresh channel after the first, so a restarted
        tokenizer is reached without waiting out the old channel's reconnect back-off)."""
        if self._detok is not None or self._watcher is not None:
            await self._drop_session()
            old, self._channel = self._channel, create_channel(self.address, tls=self.tls,
                                                               options=BACKEND_CHANNEL_OPTIONS)
            self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
            await old.close()
        await wait_ready(self._channel, self.address, timeout)
        try:
            info = await self._stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise UnavailableError(f"tokenizer at {self.address}: {exc.code().name}: {exc.details()}") from None
        call = self._stub.Detokenize()
        self._step_ids = itertools.count()
        self._detok = call
        self._watcher = asyncio.create_task(self._watch(call), name="tokenizer-session-watch")
        return info

    async def _watch(self, call) -> None:
        await call.code()  # returns when the call ends, whoever ends it
        self._lost(call)

    def _lost(self, call) -> None:
        if self._detok is call and call is not None:  # once per session, and not after close()
            self._detok = None
            self.on_lost()

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            reply = await run_to_end(self._stub.Encode(
                tokenizer_pb2.EncodeRequest(text=text, add_special_tokens=add_special_tokens), timeout=30))
        except grpc.RpcError as exc:
            raise _map_rpc_error(exc, f"tokenizer at {self.address}") from None
        return list(reply.token_ids)

    async def render_chat(self, messages, add_generation_prompt: bool) -> list[int]:
        """Token ids of the rendered conversation (the template's special tokens recognised)."""
        try:
            reply = await run_to_end(self._stub.RenderChat(tokenizer_pb2.RenderChatRequest(
                messages=messages, add_generation_prompt=add_generation_prompt), timeout=30))
        except grpc.RpcError as exc:
            raise _map_rpc_error(exc, f"tokenizer at {self.address}") from None
        return list(reply.token_ids)

    async def detokenize(self, batch: DetokenizeBatch) -> dict[int, str]:
        call = self._detok
        if call is None:
            raise UnavailableError(f"tokenizer at {self.address} is not connected")
        msg = tokenizer_pb2.DetokenizeRequest(step_id=next(self._step_ids))
        for stream_id, prompt_tail in batch.new_streams:
            msg.new_streams.add(stream_id=stream_id, prompt_token_ids=prompt_tail, skip_special_tokens=True)
        for stream_id, ids in batch.appended:
            msg.stream_ids.append(stream_id)
            msg.token_counts.append(len(ids))
            msg.token_ids.extend(ids)
        msg.closed_stream_ids.extend(batch.closed)
        try:
            await call.write(msg)
            reply = await call.read()
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            # InvalidStateError: the call had already ended (grpc's "RPC already finished"):
            # what a client must hear is that the tokenizer went away, not that text.
            self._lost(call)
            raise UnavailableError(f"tokenizer at {self.address} went away: {await _ended(call, exc)}") from None
        if reply is grpc.aio.EOF:
            self._lost(call)
            raise UnavailableError(f"tokenizer at {self.address} ended the detokenize stream: "
                                   f"{await _ended(call, None)}")
        return dict(zip(reply.stream_ids, reply.text_deltas))

    async def _drop_session(self) -> None:
        call, self._detok = self._detok, None  # first, so the watcher does not report it
        if call is not None:
            call.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    async def close(self) -> None:
        await self._drop_session()
        await self._channel.close()


class TokenizerPool:
    """Several stateless tokenizer services: unary calls round-robin, each request's
    detokenization pinned to one tokenizer's stream (its state lives there)."""

    def __init__(self, addresses: Sequence[str], tls: ClientTLS | None = None) -> None:
        if not addresses:
            raise ValueError("tokenizer_addresses must name at least one tokenizer service")
        self.links = [TokenizerLink(a, tls) for a in addresses]
        self._next = itertools.cycle(range(len(self.links)))
        self._next_unary = itertools.cycle(range(len(self.links)))
        """Encode/RenderChat keep their own turn, so a text request's Encode does not move the
        turn that pins detokenization (with two tokenizers, every text request would otherwise
        be pinned to the same one)."""
        self.info: tokenizer_pb2.TokenizerInfo | None = None

    async def connect(self, timeout: float) -> tokenizer_pb2.TokenizerInfo:
        infos = await asyncio.gather(*(link.connect(timeout) for link in self.links))
        self.info = infos[0]
        return self.info

    @property
    def connected(self) -> bool:
        """At least one tokenizer can take a new request."""
        return any(link.connected for link in self.links)

    def pick(self, turn=None) -> int:
        """The next connected tokenizer, round-robin; UnavailableError when none is."""
        turn = turn or self._next
        for _ in range(len(self.links)):
            index = next(turn)
            if self.links[index].connected:
                return index
        raise UnavailableError(f"tokenizer at {', '.join(link.address for link in self.links)} is unavailable; "
                               "retry shortly")

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self.links[self.pick(self._next_unary)].encode(text, add_special_tokens)

    async def render_chat(self, messages, add_generation_prompt: bool) -> list[int]:
        return await self.links[self.pick(self._next_unary)].render_chat(messages, add_generation_prompt)

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self.links), return_exceptions=True)


async def _ended(call, exc: BaseException | None) -> str:
    """How a stream call ended, as its status (never an asyncio state error's text)."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    try:
        code = await asyncio.wait_for(call.code(), 1.0)
        return f"{code.name}: {await call.details()}"
    except (asyncio.TimeoutError, grpc.RpcError):
        return "the stream broke"


def _map_rpc_error(exc: grpc.RpcError, who: str) -> Exception:
    code = exc.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgumentError(exc.details())
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return InvalidArgumentError(exc.details())
    return UnavailableError(f"{who}: {code.name}: {exc.details()}")
