"""The drafter service tests' stub, on the module's own ``server`` fixture."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from services.common.pb.tokenmill.v1 import drafter_pb2_grpc
from services.common.server import RunningServer, create_channel


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stub(server: RunningServer) -> AsyncIterator[drafter_pb2_grpc.DrafterStub]:
    async with create_channel(server.address) as channel:
        yield drafter_pb2_grpc.DrafterStub(channel)

