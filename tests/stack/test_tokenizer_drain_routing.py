"""A tokenizer that drains (its server stopping with a grace, as on SIGTERM) behind a scheduler
with another one: the streams pinned to it keep their text to the end, new requests go to the
other tokenizer from the moment its health leaves SERVING, and nothing fails."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2

from services.common.pb.tokenmill.v1 import generation_pb2_grpc
from services.common.server import create_channel
from tests.helpers.service_harness import health_status
from tests.helpers.small_stack import start_small_stack
from tests.helpers.stack_streams import greedy_request, record_stream

SERVING = health_pb2.HealthCheckResponse.SERVING

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("one_torch_thread")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack():
    small = await start_small_stack(num_blocks=256, tokenizers=2)
    yield small.tokenizers, small.scheduler, small.channel
    await small.stop()


async def still_serving(address: str) -> bool:
    """A new client's view: SERVING, or not (a stopping server refuses new connections)."""
    async with create_channel(address) as channel:
        try:
            return await health_status(channel, "") == SERVING
        except grpc.aio.AioRpcError:
            return False


async def test_a_draining_tokenizer_finishes_its_streams_and_takes_no_new_request(stack) -> None:
    tokenizers, scheduler, channel = stack
    stub = generation_pb2_grpc.GenerationStub(channel)
    prompts = [f"The cat number {i}" for i in range(4)]
    references = [await record_stream(stub, greedy_request(p, 96)) for p in prompts]
    # Admitted in turn, two streams pinned to each tokenizer.
    running = [asyncio.Event() for _ in prompts]
    streams = []
    for prompt, event in zip(prompts, running):
        streams.append(asyncio.create_task(record_stream(stub, greedy_request(prompt, 96), on_delta=event)))
        await asyncio.wait_for(event.wait(), 30)
    drain = asyncio.create_task(tokenizers[0].stop(grace=60))
    deadline = time.monotonic() + 10
    while await still_serving(tokenizers[0].address):
        assert time.monotonic() < deadline, "the tokenizer never left SERVING"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # the scheduler's health watch hears of it
    # While it drains: new requests (Encode and text) all go to the other tokenizer.
    late = await asyncio.gather(*(record_stream(stub, greedy_request(p, 16)) for p in prompts))
    assert [r.finish_reason for r in late] == ["length"] * len(prompts)
    records = await asyncio.wait_for(asyncio.gather(*streams), 60)
    assert [r.finish_reason for r in records] == ["length"] * len(prompts)
    assert [r.text for r in records] == [r.text for r in references]
    assert not drain.done()  # the draining tokenizer still serves the scheduler's open session
    drain.cancel()
