"""start_server / run_service / ErrorMappingInterceptor against a test-only generic service."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    TokenmillError,
    UnavailableError,
    error_from_rpc,
)
from services.common.pb.tokenmill.v1 import tokenizer_pb2
from services.common.server import FINAL_WRITES_S, RunningServer, create_channel, server_options, start_server

REPO_ROOT = Path(__file__).resolve().parents[2]
PROBE_SERVICE = "tokenmill.test.Probe"

# Request payload -> what the handler raises. Payloads and responses are raw bytes.
ERRORS: dict[bytes, Exception] = {
    b"invalid": InvalidArgumentError("top_p must be in (0, 1], got 0"),
    b"value": ValueError("max_tokens must be > 0"),
    b"notfound": NotFoundError("request r-1 is not live"),
    b"exhausted": ResourceExhaustedError("queue holds 1024 requests; the limit is 1024"),
    b"unavailable": UnavailableError("executor at 127.0.0.1:1 is down"),
    b"deadline": DeadlineExceededError("step took longer than 30 s"),
    b"notimpl": NotImplementedError("beam search"),
    b"boom": RuntimeError("kaput"),
}
EXPECTED: dict[bytes, tuple[grpc.StatusCode, str]] = {
    b"invalid": (grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1], got 0"),
    b"value": (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be > 0"),
    b"notfound": (grpc.StatusCode.NOT_FOUND, "request r-1 is not live"),
    b"exhausted": (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue holds 1024 requests; the limit is 1024"),
    b"unavailable": (grpc.StatusCode.UNAVAILABLE, "executor at 127.0.0.1:1 is down"),
    b"deadline": (grpc.StatusCode.DEADLINE_EXCEEDED, "step took longer than 30 s"),
    b"notimpl": (grpc.StatusCode.UNIMPLEMENTED, "beam search"),
    b"boom": (grpc.StatusCode.INTERNAL, "internal error"),  # the exception's text is logged, not sent
}


def maybe_raise(payload: bytes) -> None:
    if payload in ERRORS:
        raise ERRORS[payload]


async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request.startswith(b"sleep:"):
        await asyncio.sleep(float(request[6:]))
        return b"slept"
    if request == b"abort":
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "handler chose this")
    maybe_raise(request)
    return b"ok:" + request


async def server_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"first"
    maybe_raise(request)
    yield b"second"


async def server_stream_writer(request: bytes, context: grpc.aio.ServicerContext) -> None:
    # The other asyncio streaming style: a coroutine that writes.
    await context.write(b"first")
    maybe_raise(request)
    await context.write(b"second")


async def bidi(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    async for request in requests:
        maybe_raise(request)
        yield b"echo:" + request


async def client_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    seen = []
    async for request in requests:
        maybe_raise(request)
        seen.append(request)
    return b",".join(seen)


async def echo_decoded(request: Any, context: grpc.aio.ServicerContext) -> bytes:
    return b"decoded:" + request.text.encode()


async def echo_decoded_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"decoded:" + request.text.encode()


async def echo_decoded_bidi(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    async for request in requests:
        yield b"decoded:" + request.text.encode()


def add_probe(server: grpc.aio.Server) -> list[str]:
    # Handlers that decode a real message, to check what an undecodable body gets.
    decoded = {"request_deserializer": tokenizer_pb2.EncodeRequest.FromString}
    handlers = {
        "DecodedUnary": grpc.unary_unary_rpc_method_handler(echo_decoded, **decoded),
        "DecodedServerStream": grpc.unary_stream_rpc_method_handler(echo_decoded_stream, **decoded),
        "DecodedBidi": grpc.stream_stream_rpc_method_handler(echo_decoded_bidi, **decoded),
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
        "ServerStreamWriter": grpc.unary_stream_rpc_method_handler(server_stream_writer),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PROBE_SERVICE, handlers),))
    return [PROBE_SERVICE]


@pytest.fixture
async def running() -> AsyncIterator[RunningServer]:
    server = await start_server("probe", add_probe, host="127.0.0.1", port=0)
    yield server
    await server.stop(grace=0)


@pytest.fixture
async def channel(running: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    async with create_channel(running.address) as ch:
        yield ch


def method(channel: grpc.aio.Channel, kind: str, name: str):
    return getattr(channel, kind)(f"/{PROBE_SERVICE}/{name}")


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


# --- start-up: port, health, reflection ---


async def test_binds_a_free_port_and_reports_serving(running: RunningServer, channel: grpc.aio.Channel) -> None:
    assert running.port > 0
    assert running.address == f"127.0.0.1:{running.port}"
    assert running.service_names == (PROBE_SERVICE,)
    assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    assert await health_status(channel, PROBE_SERVICE) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await health_status(channel, "tokenmill.v1.Unknown")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert await method(channel, "unary_unary", "Unary")(b"hi", timeout=5) == b"ok:hi"


async def reflection_request(channel: grpc.aio.Channel, request: reflection_pb2.ServerReflectionRequest):
    call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request]), timeout=5)
    return [reply async for reply in call][0]


async def test_reflection_lists_services_and_serves_tokenmill_descriptors(channel: grpc.aio.Channel) -> None:
    listed = await reflection_request(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in listed.list_services_response.service}
    assert names == {PROBE_SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    # Descriptors of the generated stubs resolve under their proto path (see gen_protos.py).
    from services.common.pb.tokenmill.v1 import executor_pb2  # noqa: F401 - registers the file

    found = await reflection_request(
        channel, reflection_pb2.ServerReflectionRequest(file_containing_symbol="tokenmill.v1.Executor")
    )
    from google.protobuf import descriptor_pb2

    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in found.file_descriptor_response.file_descriptor_proto]
    assert files[0].name == "tokenmill/v1/executor.proto"
    assert "tokenmill/v1/common.proto" in files[0].dependency


async def test_not_serving_until_told(channel: grpc.aio.Channel) -> None:
    late = await start_server("late", add_probe, port=0, serving=False)
    try:
        async with create_channel(late.address) as ch:
            assert await health_status(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await health_status(ch, PROBE_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
            await late.set_serving()
            assert await health_status(ch) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await late.stop(grace=0)


async def test_port_clash_raises_unavailable(running: RunningServer) -> None:
    with pytest.raises(UnavailableError, match=rf"clash: cannot listen on 127.0.0.1:{running.port}"):
        await start_server("clash", add_probe, port=running.port)


# --- error mapping ---


@pytest.mark.parametrize("payload", list(EXPECTED))
async def test_unary_errors_map_to_status(channel: grpc.aio.Channel, payload: bytes) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await method(channel, "unary_unary", "Unary")(payload, timeout=5)
    assert (err.value.code(), err.value.details()) == EXPECTED[payload]


@pytest.mark.parametrize("name", ["ServerStream", "ServerStreamWriter"])
@pytest.mark.parametrize("payload", list(EXPECTED))
async def test_server_stream_errors_map_to_status_after_partial_output(
    channel: grpc.aio.Channel, name: str, payload: bytes
) -> None:
    call = method(channel, "unary_stream", name)(payload, timeout=5)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for reply in call:
            received.append(reply)
    assert received == [b"first"]
    assert (err.value.code(), err.value.details()) == EXPECTED[payload]


@pytest.mark.parametrize("payload", [b"invalid", b"exhausted", b"boom"])
async def test_bidi_and_client_stream_errors_map_to_status(channel: grpc.aio.Channel, payload: bytes) -> None:
    call = method(channel, "stream_stream", "Bidi")(iter([b"a", payload, b"c"]), timeout=5)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for reply in call:
            received.append(reply)
    assert received == [b"echo:a"]
    assert (err.value.code(), err.value.details()) == EXPECTED[payload]

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await method(channel, "stream_unary", "ClientStream")(iter([b"a", payload]), timeout=5)
    assert (err.value.code(), err.value.details()) == EXPECTED[payload]


UNDECODABLE = b"\xff\xff\xff\xff"  # not a valid protobuf tag


@pytest.mark.parametrize("kind, name", [("unary_unary", "DecodedUnary"), ("unary_stream", "DecodedServerStream"),
                                        ("stream_stream", "DecodedBidi")])
async def test_an_undecodable_request_is_invalid_argument(channel: grpc.aio.Channel, kind: str, name: str) -> None:
    # grpc answers UNKNOWN (unary) or the handler INTERNAL (streamed) with its exception text.
    good = tokenizer_pb2.EncodeRequest(text="hi").SerializeToString()
    if kind == "stream_stream":
        assert [r async for r in method(channel, kind, name)(iter([good]), timeout=5)] == [b"decoded:hi"]
        call = method(channel, kind, name)(iter([good, UNDECODABLE]), timeout=5)
    else:
        ok = method(channel, kind, name)(good, timeout=5)
        assert (await ok if kind == "unary_unary" else [r async for r in ok][0]) == b"decoded:hi"
        call = method(channel, kind, name)(UNDECODABLE, timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        if kind == "unary_unary":
            await call
        else:
            [r async for r in call]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(
        "the request could not be decoded: Error parsing message with type 'tokenmill.v1.EncodeRequest'")


async def test_successful_streams_pass_through(channel: grpc.aio.Channel) -> None:
    assert [r async for r in method(channel, "unary_stream", "ServerStream")(b"fine", timeout=5)] == [b"first", b"second"]
    assert [r async for r in method(channel, "stream_stream", "Bidi")(iter([b"x", b"y"]), timeout=5)] == [b"echo:x", b"echo:y"]
    assert await method(channel, "stream_unary", "ClientStream")(iter([b"x", b"y"]), timeout=5) == b"x,y"


async def test_handler_abort_is_left_alone(channel: grpc.aio.Channel) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await method(channel, "unary_unary", "Unary")(b"abort", timeout=5)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.PERMISSION_DENIED, "handler chose this")


async def test_internal_errors_log_the_traceback(channel: grpc.aio.Channel) -> None:
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(grpc.aio.AioRpcError):
            await method(channel, "unary_unary", "Unary")(b"boom", timeout=5)
        with pytest.raises(grpc.aio.AioRpcError):
            await method(channel, "unary_unary", "Unary")(b"invalid", timeout=5)
    internal = [e for e in logs if e["event"] == "rpc_internal_error"]
    assert len(internal) == 1
    assert internal[0]["method"] == f"/{PROBE_SERVICE}/Unary" and internal[0]["exc_info"] is True
    assert [e["code"] for e in logs if e["event"] == "rpc_error"] == ["INVALID_ARGUMENT"]


async def test_downstream_status_is_passed_on_and_typed_on_the_client(running: RunningServer) -> None:
    # A handler that calls another service (here: the same server) and lets its error escape.
    async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async with create_channel(running.address) as ch:
            return await ch.unary_unary(f"/{PROBE_SERVICE}/Unary")(request, timeout=5)

    def add_relay(server: grpc.aio.Server) -> list[str]:
        handler = grpc.method_handlers_generic_handler("tokenmill.test.Relay", {"Call": grpc.unary_unary_rpc_method_handler(relay)})
        server.add_generic_rpc_handlers((handler,))
        return ["tokenmill.test.Relay"]

    relay_server = await start_server("relay", add_relay, port=0)
    try:
        async with create_channel(relay_server.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ch.unary_unary("/tokenmill.test.Relay/Call")(b"notfound", timeout=5)
    finally:
        await relay_server.stop(grace=0)
    assert (err.value.code(), err.value.details()) == EXPECTED[b"notfound"]
    typed = error_from_rpc(err.value)
    assert type(typed) is NotFoundError and str(typed) == "request r-1 is not live"
    assert isinstance(error_from_rpc(_FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "x")), ValueError)
    denied = error_from_rpc(_FakeRpcError(grpc.StatusCode.PERMISSION_DENIED, "no"))
    assert type(denied) is PermissionDeniedError and denied.code == grpc.StatusCode.PERMISSION_DENIED
    other = error_from_rpc(_FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "no"))
    assert type(other) is TokenmillError and other.code == grpc.StatusCode.FAILED_PRECONDITION


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


# --- graceful stop ---


async def test_graceful_stop_drains_in_flight_calls(channel: grpc.aio.Channel) -> None:
    server = await start_server("stopping", add_probe, port=0)
    cleaned: list[str] = []
    server.on_stop(lambda: cleaned.append("sync"))

    async def async_cleanup() -> None:
        cleaned.append("async")

    server.on_stop(async_cleanup)
    async with create_channel(server.address) as ch:
        in_flight = asyncio.ensure_future(method(ch, "unary_unary", "Unary")(b"sleep:0.4", timeout=5))
        await asyncio.sleep(0.1)
        stopping = asyncio.ensure_future(server.stop(grace=3, drain_seconds=0.2))
        await asyncio.sleep(0.05)
        # During the drain the server still answers, and health already says NOT_SERVING.
        assert await health_status(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await health_status(ch, PROBE_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
        await stopping
        assert await in_flight == b"slept"
        assert cleaned == ["async", "sync"]  # newest first
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await method(ch, "unary_unary", "Unary")(b"late", timeout=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    await server.stop(grace=3)  # a second stop is a no-op
    assert cleaned == ["async", "sync"]


async def test_grace_expiry_cancels_long_calls() -> None:
    server = await start_server("impatient", add_probe, port=0)
    async with create_channel(server.address) as ch:
        in_flight = asyncio.ensure_future(method(ch, "unary_unary", "Unary")(b"sleep:30", timeout=10))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await server.stop(grace=0.2)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await in_flight
    assert time.monotonic() - started < 3
    assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


async def test_one_grace_covers_the_stopping_hooks_and_the_calls() -> None:
    """A hook that waits out the grace (the scheduler waiting for its streams) leaves the calls only
    the final-writes allowance, so the stop ends within grace + FINAL_WRITES_S, not two graces."""
    server = await start_server("bounded", add_probe, port=0)
    hook_grace: list[float] = []

    async def wait_out(grace: float) -> None:
        hook_grace.append(grace)
        await asyncio.sleep(grace)

    server.on_stopping(wait_out)
    async with create_channel(server.address) as ch:
        in_flight = asyncio.ensure_future(method(ch, "unary_unary", "Unary")(b"sleep:30", timeout=20))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await server.stop(grace=3)
        elapsed = time.monotonic() - started
        with pytest.raises(grpc.aio.AioRpcError):
            await in_flight
    assert hook_grace and 2.9 < hook_grace[0] <= 3
    assert 3 + FINAL_WRITES_S - 0.2 < elapsed < 3 + FINAL_WRITES_S + 0.8, elapsed


# --- run_service in a real process: uvloop, SIGTERM, graceful stop ---

SERVICE_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    import grpc
    from services.common.logging import configure_logging
    from services.common.server import run_service, start_server

    async def unary(request, context):
        await asyncio.sleep(float(request))
        return b"done"

    def add(server):
        handler = grpc.method_handlers_generic_handler(
            "tokenmill.test.Slow", {"Sleep": grpc.unary_unary_rpc_method_handler(unary)})
        server.add_generic_rpc_handlers((handler,))
        return ["tokenmill.test.Slow"]

    async def main():
        running = await start_server("slow", add, port=0)
        running.on_stop(lambda: print("cleanup", flush=True))
        print(type(asyncio.get_running_loop()).__module__, running.port, flush=True)
        return running

    configure_logging("slow")  # JSON lines on stderr; stdout carries only what the test reads
    run_service(main, grace=5)
    print("exited", flush=True)
    """
)


async def launch_service() -> tuple[asyncio.subprocess.Process, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVICE_SCRIPT, cwd=REPO_ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    first_line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode().split()
    assert first_line[0].startswith("uvloop"), first_line
    return proc, int(first_line[1])


@pytest.mark.timeout(60)
async def test_run_service_stops_gracefully_on_sigterm() -> None:
    proc, port = await launch_service()
    try:
        async with create_channel(f"127.0.0.1:{port}") as ch:
            in_flight = asyncio.ensure_future(ch.unary_unary("/tokenmill.test.Slow/Sleep")(b"0.5", timeout=10))
            await asyncio.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            assert await in_flight == b"done"
        assert await asyncio.wait_for(proc.wait(), timeout=15) == 0
        rest = (await proc.stdout.read()).decode().split()
        assert rest == ["cleanup", "exited"]
        events = [line.split('"event": ')[1].split(",")[0] for line in (await proc.stderr.read()).decode().splitlines()]
        assert events == ['"server_started"', '"signal_received"', '"server_stopping"', '"server_stopped"']
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.timeout(60)
async def test_second_signal_cuts_the_grace_period_short() -> None:
    proc, port = await launch_service()
    try:
        async with create_channel(f"127.0.0.1:{port}") as ch:
            in_flight = asyncio.ensure_future(ch.unary_unary("/tokenmill.test.Slow/Sleep")(b"30", timeout=20))
            await asyncio.sleep(0.2)
            started = time.monotonic()
            proc.send_signal(signal.SIGINT)
            await asyncio.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await in_flight
        assert await asyncio.wait_for(proc.wait(), timeout=15) == 0
        assert time.monotonic() - started < 4  # the grace period is 5 s
        assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert (await proc.stdout.read()).decode().split() == ["cleanup", "exited"]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_calls_beyond_max_concurrent_rpcs_are_refused_before_a_handler_runs() -> None:
    server = await start_server("capped", add_probe, port=0, max_concurrent_rpcs=2)
    try:
        async with create_channel(server.address) as channel:
            sleepers = [asyncio.ensure_future(method(channel, "unary_unary", "Unary")(b"sleep:1.0", timeout=10))
                        for _ in range(2)]
            await asyncio.sleep(0.3)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await method(channel, "unary_unary", "Unary")(b"now", timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await asyncio.gather(*sleepers) == [b"slept", b"slept"]
            assert await method(channel, "unary_unary", "Unary")(b"now", timeout=10) == b"ok:now"
    finally:
        await server.stop(grace=0)


def test_pings_are_bounded() -> None:
    options = dict(server_options())
    assert options["grpc.http2.max_ping_strikes"] == 2  # 0 let a client ping without limit
    assert options["grpc.http2.min_recv_ping_interval_without_data_ms"] < options["grpc.keepalive_time_ms"]
