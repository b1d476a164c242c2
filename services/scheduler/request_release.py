"""Let go of a Generate request's message once the servicer has taken its fields.

grpc.aio's handler for a unary request keeps the deserialized message in its frame until the
call ends (beside the raw bytes, which the message limit bounds), so a stream that lasts
minutes holds its request all that time, unknown fields and all. This interceptor hands the
server a box instead: the server holds the box; the servicer gets the message out of it, takes
what it needs (GenerationServicer._intake) and drops it, and the message is freed then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc.aio

from services.common.interceptor import BehaviorInterceptor, StreamBehavior, UnaryBehavior

GENERATE_METHOD = "/tokenmill.v1.Generation/Generate"


class RequestBox:
    """What the server holds for the call: the message until the handler takes it."""

    __slots__ = ("message",)

    def __init__(self, message: Any) -> None:
        self.message = message

    def take(self) -> Any:
        message, self.message = self.message, None
        return message


class RequestRelease(BehaviorInterceptor):
    """Boxes Generate's request (install it innermost, next to the servicer)."""

    def wrap_deserializer(self, deserializer: Callable[[bytes], Any] | None, method: str,
                          request_streaming: bool) -> Callable[[bytes], Any] | None:
        if method != GENERATE_METHOD or deserializer is None or request_streaming:
            return deserializer

        def deserialize(data: bytes) -> RequestBox:
            return RequestBox(deserializer(data))

        return deserialize

    def wrap_unary(self, behavior: UnaryBehavior, method: str) -> UnaryBehavior:
        return behavior

    def wrap_stream(self, behavior: StreamBehavior, method: str) -> StreamBehavior:
        if method != GENERATE_METHOD:
            return behavior

        async def handler(box: RequestBox, context: grpc.aio.ServicerContext):
            # The message goes straight into the servicer's frame: no name here holds it.
            async for response in behavior(box.take(), context):
                yield response

        return handler
