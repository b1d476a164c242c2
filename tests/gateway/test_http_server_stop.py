"""The gateway's HTTP server stops accepting the moment its stop begins: health is NOT_SERVING
by then, so a connection accepted later would reach a server already draining. An open
response still finishes within the grace."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from services.gateway.http.connection_limits import ConnectionLimits
from services.gateway.http.server import start_http


def _app(release: asyncio.Event) -> FastAPI:
    app = FastAPI()

    @app.get("/slow")
    async def slow():
        async def body():
            yield b"first\n"
            await release.wait()
            yield b"last\n"
        return StreamingResponse(body())

    return app


async def _get(port: int, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


async def test_stop_refuses_new_connections_at_once_and_finishes_open_responses():
    release = asyncio.Event()
    http = await start_http(_app(release), "127.0.0.1", 0, ConnectionLimits(10.0, 64 * 1024, 100))
    reader, writer = await _get(http.port, "/slow")
    assert (await reader.readuntil(b"first\n")).startswith(b"HTTP/1.1 200")
    stopping = asyncio.ensure_future(http.stop(grace=10.0))
    await asyncio.sleep(0)  # the stop has begun; uvicorn's own loop has not ticked since
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", http.port)
    release.set()
    assert (await reader.readuntil(b"last\n")).endswith(b"last\n")
    writer.close()
    await asyncio.wait_for(stopping, timeout=10.0)
    assert http.task.done()
