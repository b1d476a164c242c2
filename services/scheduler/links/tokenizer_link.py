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
from services.common.tls import ClientTLS
from services.scheduler.links.backend_channel import BackendChannel
from services.scheduler.links.channel import ended, map_rpc_error, run_to_end


class _Session:
    """One Detokenize stream: the text state of every request pinned to its tokenizer. Watched,
    so its end (the tokenizer died or restarted) is reported once, at once, to ``on_end``; the
    tokenizer's health is watched beside it (``health``)."""

    def __init__(self, channel: grpc.aio.Channel, metadata, address: str,
                 on_end: Callable[[_Session], None]) -> None:
        self.call = tokenizer_pb2_grpc.TokenizerStub(channel).Detokenize(metadata=metadata)
        self._address = address
        self._on_end = on_end
        self._step_ids = itertools.count()
        self._watcher = asyncio.create_task(self._watch(), name="tokenizer-session-watch")
        self.health = _HealthWatch()
        self.health.start(channel)

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
        self.health.stop()


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
    """One tokenizer service: unary Encode/RenderChat (``prompts``) plus one Detokenize stream.

    The Detokenize stream holds the state of every request's text, so it is a session like
    the executor's: when it ends (the tokenizer died or restarted), the link is down until
    ``connect`` opens a new one, and ``on_lost`` is called once so the owner can end the
    requests pinned to it and reconnect.
    """

    def __init__(self, address: str, tls: ClientTLS | None = None, on_lost: Callable[[], None] = lambda: None,
                 secret: str = "") -> None:
        self.address = address
        self.backend = BackendChannel("tokenizer", address, tls, secret)
        self.prompts = TokenizerPrompts(self.backend)
        self.backend.open()
        self._session: _Session | None = None
        self._sessions = 0  # opened: every one after the first gets a fresh channel
        self._on_lost = on_lost  # called once each time a connected Detokenize session ends

    @property
    def connected(self) -> bool:
        return self._session is not None

    @property
    def accepting(self) -> bool:
        """Connected and not draining: a new request may be pinned here. A stopping tokenizer (SIGTERM,
        a pod's drain) reports NOT_SERVING while it serves the requests pinned to it to their end."""
        return self._session is not None and not self._session.health.draining

    async def connect(self, timeout: float) -> tokenizer_pb2.TokenizerInfo:
        """Open a new Detokenize session (on a fresh channel after the first, so a restarted
        tokenizer is reached without waiting out the old channel's reconnect back-off)."""
        if self._sessions:
            self._drop_session()
            await self.backend.reopen()
        await self.backend.ready(timeout)
        info = await _tokenizer_info(self.backend, timeout)
        self._session = _Session(self.backend.channel, self.backend.metadata, self.address, self._lost)
        self._sessions += 1
        return info

    def _lost(self, session: _Session) -> None:
        if self._session is session:  # once per session, and not after close()
            self._session = None
            session.health.stop()
            self._on_lost()

    async def detokenize(self, batch: DetokenizeBatch) -> DetokenizeResult:
        if self._session is None:
            raise UnavailableError(f"tokenizer at {self.address} is not connected")
        return await self._session.detokenize(batch)

    def _drop_session(self) -> None:
        session, self._session = self._session, None  # first, so its watcher does not report it
        if session is not None:
            session.cancel()

    async def close(self) -> None:
        self._drop_session()
        await self.backend.close()


async def _tokenizer_info(backend: BackendChannel, timeout: float) -> tokenizer_pb2.TokenizerInfo:
    try:
        return await tokenizer_pb2_grpc.TokenizerStub(backend.channel).GetTokenizerInfo(
            tokenizer_pb2.GetTokenizerInfoRequest(), timeout=timeout, metadata=backend.metadata)
    except grpc.RpcError as exc:
        raise UnavailableError(f"tokenizer at {backend.address}: {exc.code().name}: {exc.details()}") from None


class TokenizerPrompts:
    """A tokenizer's unary prompt calls: stateless, so any tokenizer may take any of them."""

    def __init__(self, backend: BackendChannel) -> None:
        self.backend = backend

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        stub = tokenizer_pb2_grpc.TokenizerStub(self.backend.required())
        return await self._prompt(stub.Encode(
            tokenizer_pb2.EncodeRequest(text=text, add_special_tokens=add_special_tokens), timeout=30,
            metadata=self.backend.metadata))

    async def render_chat(self, messages, add_generation_prompt: bool, tools_json: str = "") -> list[int]:
        """Token ids of the rendered conversation (the template's special tokens recognised;
        ``tools_json``: the template's ``tools``, "" for none)."""
        stub = tokenizer_pb2_grpc.TokenizerStub(self.backend.required())
        return await self._prompt(stub.RenderChat(tokenizer_pb2.RenderChatRequest(
            messages=messages, add_generation_prompt=add_generation_prompt, tools_json=tools_json), timeout=30,
            metadata=self.backend.metadata))

    async def _prompt(self, call) -> list[int]:
        try:
            reply = await run_to_end(call)
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, "tokenizer", self.backend.address) from None
        return list(reply.token_ids)


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
        return await self._pick().prompts.encode(text, add_special_tokens)

    async def render_chat(self, messages, add_generation_prompt: bool, tools_json: str = "") -> list[int]:
        return await self._pick().prompts.render_chat(messages, add_generation_prompt, tools_json)

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self.links), return_exceptions=True)
