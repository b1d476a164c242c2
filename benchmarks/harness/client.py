"""A run's client of the public Generation API: Generate streams read into RequestRecords."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import uvloop

from benchmarks.harness.records import RequestRecord
from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import create_channel
from services.stack.client import build_request


def greedy_request(prompt: str | list[int] | None, max_tokens: int, **kwargs) -> generation_pb2.GenerateRequest:
    """Greedy, EOS ignored: every system does exactly ``max_tokens`` of work."""
    return build_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


@asynccontextmanager
async def generation_stub(address: str) -> AsyncIterator[generation_pb2_grpc.GenerationStub]:
    async with create_channel(address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


async def stream(stub, request: generation_pb2.GenerateRequest, record: RequestRecord | None = None, *,
                 timeout: float = 3600, on_first_token=None) -> RequestRecord:
    """Read one Generate stream: each delta's ids and arrival time, the Finished time; a failed
    call's status goes into ``record.error``. Without a record, one sent now. ``on_first_token``
    is called once, as the first delta arrives."""
    if record is None:
        record = RequestRecord(-1, len(request.token_ids.ids), request.stop.max_tokens, time.perf_counter())
    try:
        async for reply in stub.Generate(request, timeout=timeout):
            kind = reply.WhichOneof("event")
            if kind == "delta":
                first = not record.chunk_times
                record.add_chunk(time.perf_counter(), list(reply.delta.token_ids))
                if first and on_first_token is not None:
                    on_first_token()
            elif kind == "finished":
                record.finish_time = time.perf_counter()
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    return record


async def stream_ok(stub, request: generation_pb2.GenerateRequest, *, timeout: float = 3600) -> RequestRecord:
    """``stream``, sent now, and a RuntimeError when the call failed or produced no token."""
    record = await stream(stub, request, timeout=timeout)
    if not record.ok:
        raise RuntimeError(f"a stream failed: {record.error or 'no tokens or no Finished'}")
    return record


async def _same_request(address: str, request: generation_pb2.GenerateRequest, streams: int,
                        timeout: float) -> tuple[float, list[RequestRecord]]:
    async with create_channel(address) as channel:
        await channel.channel_ready()  # connecting stays out of the timing
        stub = generation_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter()
        records = await asyncio.gather(*(stream_ok(stub, request, timeout=timeout) for _ in range(streams)))
        return time.perf_counter() - start, list(records)


def same_request(address: str, request: generation_pb2.GenerateRequest, streams: int,
                 timeout: float = 600) -> tuple[float, list[RequestRecord]]:
    """``streams`` copies of ``request`` sent at once over one connected channel: the seconds
    from sending them to the last token, and their records. On uvloop, as the services run:
    the client shares the cores with the stack it measures."""
    return uvloop.run(_same_request(address, request, streams, timeout))
