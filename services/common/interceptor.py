"""A server interceptor that wraps the behavior of every async handler, unary or streaming.

grpc.aio picks a handler's calling convention from its function type (a coroutine function,
or an async generator), so a wrapper must keep the type of what it wraps, and the rebuilt
handler must keep its kind and (de)serializers. That is the same for every interceptor that
runs code around a call; subclasses only say what runs around one call, for a unary response
(``wrap_unary``) and for a streamed one (``wrap_stream``). Synchronous handlers run in a
thread pool, out of reach of an awaitable; no tokenmill service has one, so they pass through.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamBehavior = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]

_HANDLER_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


class BehaviorInterceptor(grpc.aio.ServerInterceptor):
    """Base class: rebuilds each handler around ``wrap_unary``/``wrap_stream`` of its behavior."""

    def wrap_unary(self, behavior: UnaryBehavior, method: str) -> UnaryBehavior:
        raise NotImplementedError

    def wrap_stream(self, behavior: StreamBehavior, method: str) -> StreamBehavior:
        raise NotImplementedError

    def wrap_deserializer(
        self, deserializer: Callable[[bytes], Any] | None, method: str, request_streaming: bool
    ) -> Callable[[bytes], Any] | None:
        """The request deserializer the rebuilt handler uses; the same one unless overridden."""
        return deserializer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return rebuild_handler(handler, lambda b: self.wrap_unary(b, method), lambda b: self.wrap_stream(b, method),
                               lambda d, streaming: self.wrap_deserializer(d, method, streaming))


def rebuild_handler(
    handler: grpc.RpcMethodHandler,
    wrap_unary: Callable[[UnaryBehavior], UnaryBehavior],
    wrap_stream: Callable[[StreamBehavior], StreamBehavior],
    wrap_deserializer: Callable[[Callable[[bytes], Any] | None, bool], Callable[[bytes], Any] | None] | None = None,
) -> grpc.RpcMethodHandler:
    """``handler`` of the same kind and serializers, its behavior wrapped by ``wrap_unary`` (a
    coroutine function) or ``wrap_stream`` (an async generator function)."""
    for kind, build in _HANDLER_KINDS:
        behavior = getattr(handler, kind)
        if behavior is not None:
            deserializer = handler.request_deserializer
            if wrap_deserializer is not None:
                deserializer = wrap_deserializer(deserializer, kind.startswith("stream"))
            if inspect.isasyncgenfunction(behavior):
                behavior = wrap_stream(behavior)
            elif inspect.iscoroutinefunction(behavior):
                behavior = wrap_unary(behavior)
            return build(behavior, request_deserializer=deserializer, response_serializer=handler.response_serializer)
    return handler


REFUSAL_READ_MESSAGES = 4
"""A refused call's streamed request is read (and dropped) up to this many messages first."""

REFUSAL_READ_S = 1.0
"""... and for at most this long: a client that keeps its stream open gets its status then."""


async def refuse(request: Any, context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str,
                 trailers: tuple[tuple[str, str], ...] = ()) -> None:
    """End the call with ``code``. A streamed request is read first, until the client half-closes
    (at most REFUSAL_READ_MESSAGES messages, REFUSAL_READ_S seconds), and dropped.

    Why read what is refused: grpc.aio's client reports a call that ends while one of its writes
    is still in flight as INTERNAL ("Internal error from Core", failed SendMessageOperation) in
    place of the status the server sent (grpc/grpc#36066). A status sent before the client's
    first message arrived reached about one refused bidirectional call in twenty (under load) as
    INTERNAL. Once the client has half-closed, or is waiting for a reply to what it sent, no
    write is in flight and it sees the real status; only a client still writing when the bound
    runs out can meet that client-side race.
    """
    if hasattr(request, "__aiter__"):
        with contextlib.suppress(Exception, asyncio.TimeoutError):
            async with asyncio.timeout(REFUSAL_READ_S):
                read = 0
                async for _ in request:
                    read += 1
                    if read >= REFUSAL_READ_MESSAGES:
                        break
    await context.abort(code, details, trailing_metadata=trailers)


def refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str,
                     trailers: tuple[tuple[str, str], ...] = ()) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers ``code`` without decoding the request (no
    deserializer: a unary body stays raw bytes, a streamed one is read as raw bytes and dropped,
    see ``refuse``)."""

    async def refuse_call(request: Any, context: grpc.aio.ServicerContext) -> None:
        await refuse(request, context, code, details, trailers)

    # A coroutine (not an async generator) is grpc.aio's writer form for streamed responses; it
    # writes nothing here.
    for kind, build in _HANDLER_KINDS:
        if getattr(handler, kind) is not None:
            return build(refuse_call, response_serializer=handler.response_serializer)
    return handler
