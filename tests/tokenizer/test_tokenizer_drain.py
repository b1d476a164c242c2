"""The tokenizer process's drain on SIGTERM (what a Kubernetes pod stop sends): health leaves
SERVING and new connections are refused at once, while a scheduler's open Detokenize session,
holding the text of 16 requests still generating, keeps being served until it is closed; the
process then exits 0, well within its grace. A session still open at the end of the grace is cut,
and the process still exits within it."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb.tokenmill.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.server import create_channel
from tests.helpers.service_harness import StreamSession, launch_module, wait_for_port_file

pytestmark = [pytest.mark.asyncio(loop_scope="function"), pytest.mark.slow]

STREAMS = 16
TOKENS = [403, 407, 261, 378]
"""stories260K's "Once upon a time"."""
GRACE_S = 30.0


async def _start(tmp_path: Path, grace: float) -> tuple[asyncio.subprocess.Process, int]:
    port_file = tmp_path / "tokenizer.port"
    process = await launch_module("services.tokenizer", ["--port", "0", "--port-file", str(port_file),
                                                         "--shutdown-grace-seconds", str(grace), "--allow-unauthenticated"])
    return process, await wait_for_port_file(port_file, process)


async def _open_session(channel) -> StreamSession:
    session = StreamSession(tokenizer_pb2_grpc.TokenizerStub(channel).Detokenize)
    ids = list(range(1, STREAMS + 1))
    reply = await session.exchange(tokenizer_pb2.DetokenizeRequest(
        step_id=1, new_streams=[tokenizer_pb2.DetokenizeStream(stream_id=i) for i in ids], stream_ids=ids,
        token_counts=[1] * STREAMS, token_ids=[TOKENS[0]] * STREAMS))
    assert list(reply.stream_ids) == ids
    return session


async def _health(port: int) -> str:
    async with create_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.aio.AioRpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def _refused_at_once(port: int) -> None:
    """Health is no longer SERVING, and a new client's Encode gets UNAVAILABLE."""
    deadline = time.monotonic() + 10
    while await _health(port) == "SERVING":
        assert time.monotonic() < deadline, "still SERVING after SIGTERM"
        await asyncio.sleep(0.05)
    async with create_channel(f"127.0.0.1:{port}") as fresh:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await tokenizer_pb2_grpc.TokenizerStub(fresh).Encode(tokenizer_pb2.EncodeRequest(text="late"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value


@pytest.mark.timeout(120)
async def test_sigterm_keeps_serving_an_open_detokenize_session_then_exits(tmp_path: Path) -> None:
    process, port = await _start(tmp_path, GRACE_S)
    try:
        async with create_channel(f"127.0.0.1:{port}") as channel:
            session = await _open_session(channel)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await _refused_at_once(port)
            ids = list(range(1, STREAMS + 1))
            texts = {i: "" for i in ids}
            for step, token in enumerate(TOKENS[1:], start=2):  # the requests keep generating
                reply = await session.exchange(tokenizer_pb2.DetokenizeRequest(
                    step_id=step, stream_ids=ids, token_counts=[1] * STREAMS, token_ids=[token] * STREAMS,
                    closed_stream_ids=ids if token == TOKENS[-1] else []))
                assert reply.step_id == step and list(reply.stream_ids) == ids
                for i, delta in zip(reply.stream_ids, reply.text_deltas):
                    texts[i] += delta
            assert all(text.strip().endswith("upon a time") for text in texts.values()), texts
            assert await session.close() == grpc.StatusCode.OK
            closed = time.monotonic()
        assert await asyncio.wait_for(process.wait(), timeout=GRACE_S) == 0
        exited = time.monotonic()
        assert exited - signalled < GRACE_S and exited - closed < 5, (exited - signalled, exited - closed)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.timeout(60)
async def test_a_session_open_past_the_grace_is_cut_and_the_process_exits_within_it(tmp_path: Path) -> None:
    grace = 3.0
    process, port = await _start(tmp_path, grace)
    try:
        async with create_channel(f"127.0.0.1:{port}") as channel:
            session = await _open_session(channel)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert await asyncio.wait_for(process.wait(), timeout=grace + 5) == 0
            assert time.monotonic() - signalled < grace + 2.0  # FINAL_WRITES_S and the exit itself
            assert await asyncio.wait_for(session.call.code(), 5) != grpc.StatusCode.OK
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
