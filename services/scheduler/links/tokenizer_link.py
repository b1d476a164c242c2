"""The scheduler's links to its tokenizers: unary Encode/RenderChat, and one Detokenize stream each.

A ``TokenizerLink`` is the engine core's DetokenizerPort over gRPC; a ``TokenizerPool`` spreads
the prompt calls of several stateless tokenizer services round-robin. With ``tls`` every link
connects over TLS (mTLS with a client certificate), its files read when the channel is made.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence

import grpc
import grpc.aio

from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.codec.detokenize_codec import batch_to_proto, result_from_proto
from services.common.detokenize import DetokenizeBatch, DetokenizeResult
from services.common.errors import UnavailableError
from services.common.pb.tokenmill.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.internal_secret import call_metadata
from services.common.server import create_channel
from services.common.tls import ClientTLS
from services.scheduler.links.channel import BACKEND_CHANNEL_OPTIONS, ended, map_rpc_error, run_to_end, wait_ready


class _Session:
    """One Detokenize stream: the text state of every request pinned to its tokenizer. Watched,
    so its end (the tokenizer died or restarted) is reported once, at once, to ``on_end``."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub, metadata, address: str,
                 on_end: Callable[[_Session], None]) -> None:
        self.call = stub.Detokenize(metadata=metadata)
        self._address = address
        self._on_end = on_end
        self._step_ids = itertools.count()
        self._watcher = asyncio.create_task(self._watch(), name="tokenizer-session-watch")

    async def _watch(self) -> None:
        await self.call.code()  # returns when the call ends, whoever ends it
        self._on_end(self)

    async def detokenize(self, batch: DetokenizeBatch) -> DetokenizeResult:
        call = self.call
        try:
            await call.write(batch_to_proto(batch, next(self._step_ids)))
            reply = await call.read()
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            # InvalidStateError: the call had already ended (grpc's "RPC already finished"):
            # what a client must hear is that the tokenizer went away, not that text.
            self._on_end(self)
            raise UnavailableError(f"tokenizer at {self._address} went away: {await ended(call, exc)}") from None
        if reply is grpc.aio.EOF:
            self._on_end(self)
            raise UnavailableError(f"tokenizer at {self._address} ended the detokenize stream: "
                                   f"{await ended(call, None)}")
        return result_from_proto(reply)

    def cancel(self) -> None:
        self.call.cancel()
        self._watcher.cancel()


class _HealthWatch:
    """Follows a tokenizer's overall health (grpc.health Watch): ``draining`` while it reports
    anything but SERVING. A watch that fails (an old tokenizer without the health service, the
    channel closing) leaves it as it is: the session's own watch still notices a tokenizer
    that goes away."""

    def __init__(self) -> None:
        self.draining = False
        self._task: asyncio.Task | None = None

    def start(self, channel: grpc.aio.Channel) -> None:
        self.draining = False
        self._task = asyncio.create_task(self._watch(channel), name="tokenizer-health-watch")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self, channel: grpc.aio.Channel) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        try:
            async for reply in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest()):
                self.draining = reply.status != serving
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass


class TokenizerLink:
    """One tokenizer service: unary Encode/RenderChat plus one Detokenize stream.

    The Detokenize stream holds the state of every request's text, so it is a session like
    the executor's: when it ends (the tokenizer died or restarted), the link is down until
    ``connect`` opens a new one, and ``on_lost`` is called once so the owner can end the
    requests pinned to it and reconnect. The stream is watched, so a tokenizer that dies
    while the scheduler is idle is noticed at once, not when the next step needs it.

    The tokenizer's health is watched too: a tokenizer that is stopping (SIGTERM, a pod's
    drain) reports NOT_SERVING and refuses new calls while it serves its open session to the
    end, so from then on the link takes no new request (``accepting`` is False) and the
    requests already pinned to it keep their text stream.
    """

    def __init__(self, address: str, tls: ClientTLS | None = None, on_lost: Callable[[], None] = lambda: None,
                 secret: str = "") -> None:
        self.address = address
        self.tls = tls
        self._metadata = call_metadata(secret)
        """The deployment's internal secret, sent on every call (services/common/internal_secret.py)."""
        self._channel = create_channel(address, tls=tls, options=BACKEND_CHANNEL_OPTIONS)
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
        self._session: _Session | None = None
        self._sessions = 0
        """Sessions opened: every one after the first gets a fresh channel."""
        self._health = _HealthWatch()
        self._on_lost = on_lost
        """Called once each time a connected Detokenize session ends."""

    @property
    def connected(self) -> bool:
        return self._session is not None

    @property
    def accepting(self) -> bool:
        """Connected and not draining: a new request may be pinned here."""
        return self._session is not None and not self._health.draining

    async def connect(self, timeout: float) -> tokenizer_pb2.TokenizerInfo:
        """Open a new Detokenize session (on a fresh channel after the first, so a restarted
        tokenizer is reached without waiting out the old channel's reconnect back-off)."""
        if self._sessions:
            await self._drop_session()
            old, self._channel = self._channel, create_channel(self.address, tls=self.tls,
                                                               options=BACKEND_CHANNEL_OPTIONS)
            self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
            await old.close()
        await wait_ready(self._channel, self.address, timeout)
        try:
            info = await self._stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest(), timeout=timeout,
                                                     metadata=self._metadata)
        except grpc.RpcError as exc:
            raise UnavailableError(f"tokenizer at {self.address}: {exc.code().name}: {exc.details()}") from None
        self._session = _Session(self._stub, self._metadata, self.address, self._lost)
        self._sessions += 1
        self._health.start(self._channel)
        return info

    def _lost(self, session: _Session) -> None:
        if self._session is session:  # once per session, and not after close()
            self._session = None
            self._on_lost()

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._prompt(self._stub.Encode(
            tokenizer_pb2.EncodeRequest(text=text, add_special_tokens=add_special_tokens), timeout=30,
            metadata=self._metadata))

    async def render_chat(self, messages, add_generation_prompt: bool, tools_json: str = "") -> list[int]:
        """Token ids of the rendered conversation (the template's special tokens recognised;
        ``tools_json``: the template's ``tools``, "" for none)."""
        return await self._prompt(self._stub.RenderChat(tokenizer_pb2.RenderChatRequest(
            messages=messages, add_generation_prompt=add_generation_prompt, tools_json=tools_json), timeout=30,
            metadata=self._metadata))

    async def _prompt(self, call) -> list[int]:
        try:
            reply = await run_to_end(call)
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, "tokenizer", self.address) from None
        return list(reply.token_ids)

    async def detokenize(self, batch: DetokenizeBatch) -> DetokenizeResult:
        session = self._session
        if session is None:
            raise UnavailableError(f"tokenizer at {self.address} is not connected")
        return await session.detokenize(batch)

    async def _drop_session(self) -> None:
        session, self._session = self._session, None  # first, so its watcher does not report it
        if session is not None:
            session.cancel()
        self._health.stop()

    async def close(self) -> None:
        await self._drop_session()
        await self._channel.close()


class TokenizerPool:
    """Several stateless tokenizer services. Prompt calls go round-robin over the connected
    ones; each request's text stream is pinned to one by the engine core (its state is there)."""

    def __init__(self, addresses: Sequence[str], tls: ClientTLS | None = None,
                 on_lost: Callable[[int], None] = lambda index: None, secret: str = "") -> None:
        if not addresses:
            raise ValueError("tokenizer_addresses must name at least one tokenizer service")
        self.links = [TokenizerLink(a, tls, on_lost=lambda i=i: on_lost(i), secret=secret)
                      for i, a in enumerate(addresses)]
        self._turn = itertools.cycle(range(len(self.links)))
        self.info: tokenizer_pb2.TokenizerInfo | None = None

    async def connect(self, timeout: float) -> tokenizer_pb2.TokenizerInfo:
        infos = await asyncio.gather(*(link.connect(timeout) for link in self.links))
        self.info = infos[0]
        return self.info

    @property
    def connected(self) -> bool:
        """At least one tokenizer can take a new request (connected and not draining)."""
        return any(link.accepting for link in self.links)

    def _pick(self) -> TokenizerLink:
        for _ in range(len(self.links)):
            link = self.links[next(self._turn)]
            if link.accepting:
                return link
        raise UnavailableError("every tokenizer is unavailable; retry shortly")

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._pick().encode(text, add_special_tokens)

    async def render_chat(self, messages, add_generation_prompt: bool, tools_json: str = "") -> list[int]:
        return await self._pick().render_chat(messages, add_generation_prompt, tools_json)

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self.links), return_exceptions=True)
