"""Helpers for tests that talk to real service servers over loopback."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.service_config import read_port_file

REPO_ROOT = Path(__file__).resolve().parents[2]
STORIES_DIR = REPO_ROOT / "models" / "stories260K"
RPC_TIMEOUT = 10.0
SERVING = health_pb2.HealthCheckResponse.SERVING


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=RPC_TIMEOUT)
    return reply.status


async def reflected_services(channel: grpc.aio.Channel) -> set[str]:
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request]), timeout=RPC_TIMEOUT)
    replies = [reply async for reply in call]
    return {service.name for service in replies[0].list_services_response.service}


def standard_services(service_name: str) -> set[str]:
    """What reflection lists on every tokenmill server besides nothing else."""
    return {service_name, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


async def final_status(call: Any) -> grpc.StatusCode:
    """The status a call ended with (unary awaitable or response stream)."""
    try:
        if hasattr(call, "__aiter__"):
            [reply async for reply in call]
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def drain(call: Any) -> list[Any]:
    """Every response of a streaming call (raises its AioRpcError at the end, if any)."""
    return [reply async for reply in call]


class StreamSession:
    """A bidi call driven one request at a time: send a message, read its one response."""

    def __init__(self, method: Any) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self.call = method(self._requests(), timeout=60)

    async def _requests(self) -> AsyncIterator[Any]:
        while (message := await self._queue.get()) is not None:
            yield message

    async def exchange(self, request: Any) -> Any:
        await self._queue.put(request)
        return await self.call.read()

    async def close(self) -> grpc.StatusCode:
        """Half-close and wait for the status the server ends the call with."""
        await self._queue.put(None)
        return await self.call.code()


async def expect_status(awaitable: Any, code: grpc.StatusCode) -> str:
    """Await a unary call (or read a stream session) and return the details of its failure."""
    try:
        await awaitable
    except grpc.aio.AioRpcError as err:
        assert err.code() == code, (err.code(), err.details())
        return err.details()
    raise AssertionError(f"expected {code.name}, the call succeeded")


async def launch_module(module: str, args: Sequence[str]) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *args, cwd=REPO_ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )


async def wait_for_port_file(path: Path, process: asyncio.subprocess.Process, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        port = read_port_file(path)
        if port is not None:
            return port
        if process.returncode is not None:
            stderr = (await process.stderr.read()).decode(errors="replace")
            raise AssertionError(f"service exited with {process.returncode} before writing {path}:\n{stderr}")
        await asyncio.sleep(0.05)
    raise AssertionError(f"no port file at {path} after {timeout} s")
