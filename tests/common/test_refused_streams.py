"""A refused call ends with the refusal's own status on every kind of RPC, streamed requests
included (services/common/interceptor.py ``refuse``): grpc.aio's client turns a status that
arrives while one of its writes is in flight into INTERNAL "Internal error from Core"
(grpc/grpc#36066), so a bidirectional call refused before its messages were read came back
INTERNAL about once in twenty under load. Large messages keep a write in flight on every call,
which made the old refusal fail here on nearly every call.
"""

from __future__ import annotations

import collections

import grpc
import grpc.aio
import pytest

from services.common.internal_secret import METADATA_KEY, InternalSecretInterceptor
from services.common.server import create_channel, start_server
from tests.helpers.service_harness import final_status

SERVICE = "test.Refused"


async def echo(requests, context):
    async for request in requests:
        yield request


async def answer(request, context):
    return request


async def upload(requests, context):
    return b"".join([request async for request in requests])


def add(server: grpc.aio.Server) -> list[str]:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Bidi": grpc.stream_stream_rpc_method_handler(echo),
        "Upload": grpc.stream_unary_rpc_method_handler(upload),
        "Unary": grpc.unary_unary_rpc_method_handler(answer),
    }),))
    return [SERVICE]


async def outcome(call) -> str:
    return (await final_status(call)).name


@pytest.mark.parametrize("message_bytes", [0, 1 << 20])
async def test_a_caller_without_the_secret_is_unauthenticated_on_every_call(message_bytes) -> None:
    running = await start_server("refusing", add, front_interceptors=[InternalSecretInterceptor("s" * 40)])
    codes = collections.Counter()
    try:
        async with create_channel(running.address) as channel:
            for metadata in [None, ((METADATA_KEY, "x" * 40),)] * 20:
                messages = [b"m" * message_bytes] * 2
                codes["Bidi", await outcome(channel.stream_stream(f"/{SERVICE}/Bidi")(
                    iter(messages), timeout=10, metadata=metadata))] += 1
                codes["Upload", await outcome(channel.stream_unary(f"/{SERVICE}/Upload")(
                    iter(messages), timeout=10, metadata=metadata))] += 1
                codes["Unary", await outcome(channel.unary_unary(f"/{SERVICE}/Unary")(
                    b"m", timeout=10, metadata=metadata))] += 1
            assert codes == {(name, "UNAUTHENTICATED"): 40 for name in ("Bidi", "Upload", "Unary")}
            # With the secret the same calls pass: the refusal is the secret's doing.
            secret = ((METADATA_KEY, "s" * 40),)
            assert await outcome(channel.stream_stream(f"/{SERVICE}/Bidi")(iter([b"a"]), metadata=secret)) == "OK"
    finally:
        await running.stop(0)
