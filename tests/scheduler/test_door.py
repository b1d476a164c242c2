"""DoorInterceptor on a real grpc.aio server: Generate is refused before its body is decoded
while no request can be accepted (UNAVAILABLE) or the queue is full (RESOURCE_EXHAUSTED with
the pushback); every other method passes."""

from __future__ import annotations

import grpc
import pytest

from services.scheduler.admission import PUSHBACK_TRAILER, Admission, DoorInterceptor

SERVICE = "tokenmill.v1.Generation"


class _Backend:
    """What lies behind the door: counts the bodies decoded and the calls that reached it."""

    def __init__(self) -> None:
        self.decoded = 0
        self.reached = 0
        self.reason: str | None = None

    def decode(self, body: bytes) -> bytes:
        self.decoded += 1
        return body

    async def generate(self, request: bytes, context):
        self.reached += 1
        yield b"ok"

    async def other(self, request: bytes, context) -> bytes:
        self.reached += 1
        return b"pong"


@pytest.fixture
async def door():
    backend = _Backend()
    admission = Admission(1)
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Generate": grpc.unary_stream_rpc_method_handler(backend.generate, request_deserializer=backend.decode),
        "GetProfile": grpc.unary_unary_rpc_method_handler(backend.other, request_deserializer=backend.decode),
    })
    server = grpc.aio.server(interceptors=[DoorInterceptor(admission, unavailable=lambda: backend.reason)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield backend, admission, channel
    finally:
        await channel.close()
        await server.stop(grace=None)


async def _generate(channel) -> tuple[grpc.StatusCode, str, dict]:
    call = channel.unary_stream(f"/{SERVICE}/Generate")(b"body", timeout=10)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details(), dict(err.trailing_metadata() or ())
    return grpc.StatusCode.OK, "", {}


async def test_unavailable_is_refused_undecoded_and_other_methods_pass(door):
    backend, admission, channel = door
    backend.reason = "the executor is unavailable (restarting or unreachable); retry shortly"
    code, details, trailers = await _generate(channel)
    assert (code, details) == (grpc.StatusCode.UNAVAILABLE, backend.reason)
    assert PUSHBACK_TRAILER not in trailers
    assert backend.decoded == backend.reached == 0
    assert await channel.unary_unary(f"/{SERVICE}/GetProfile")(b"ping", timeout=10) == b"pong"
    assert backend.reached == 1


async def test_open_door_passes_then_a_full_queue_is_refused_with_the_pushback(door):
    backend, admission, channel = door
    assert await _generate(channel) == (grpc.StatusCode.OK, "", {})
    assert backend.decoded == backend.reached == 1
    place = admission.enter()  # the one place taken: the queue is full
    code, details, trailers = await _generate(channel)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_waiting_requests" in details
    assert int(trailers[PUSHBACK_TRAILER]) > 0
    assert backend.decoded == backend.reached == 1
    admission.leave(place)
    backend.reason = "the server is shutting down"  # unavailability comes before fullness
    assert (await _generate(channel))[:2] == (grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
