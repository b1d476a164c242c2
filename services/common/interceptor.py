"""A server interceptor that wraps the behavior of every async handler, unary or streaming.

grpc.aio picks a handler's calling convention from its function type (a coroutine function,
or an async generator), so a wrapper must keep the type of what it wraps, and the rebuilt
handler must keep its kind and (de)serializers. That is the same for every interceptor that
runs code around a call; subclasses only say what runs around one call, for a unary response
(``wrap_unary``) and for a streamed one (``wrap_stream``). Synchronous handlers run in a
thread pool, out of reach of an awaitable; no tokenmill service has one, so they pass through.
"""

from __future__ import annotations

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
        for kind, build in _HANDLER_KINDS:
            behavior = getattr(handler, kind)
            if behavior is not None:
                deserializer = self.wrap_deserializer(handler.request_deserializer, method, kind.startswith("stream"))
                return build(self._wrap(behavior, method), request_deserializer=deserializer,
                             response_serializer=handler.response_serializer)
        return handler

    def _wrap(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            return self.wrap_stream(behavior, method)
        if inspect.iscoroutinefunction(behavior):
            return self.wrap_unary(behavior, method)
        return behavior
