"""Two tokenizers behind one scheduler (servers in this process): when one goes away, only the
streams pinned to it end (one Finished, reason error), new requests go to the other, health
stays SERVING (a tokenizer is still there); when it comes back on its port it takes requests
again. When every tokenizer is away, health says NOT_SERVING."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2

from services.scheduler.link_keeper import TOKENIZER_LOST
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import serve as serve_tokenizer
from services.common.pb.tokenmill.v1 import generation_pb2_grpc
from tests.helpers.service_harness import STORIES_DIR, health_status
from tests.helpers.small_stack import start_small_stack
from tests.helpers.stack_streams import greedy_request, record_stream

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("one_torch_thread")]

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack():
    small = await start_small_stack(num_blocks=256, tokenizers=2)
    yield small.tokenizers, small.scheduler, small.channel
    await small.stop()


async def wait_health(channel, want: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while await health_status(channel, "tokenmill.v1.Generation") != want:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert await health_status(channel, "") == want


async def test_one_tokenizer_away_ends_only_its_streams_and_the_other_serves(stack) -> None:
    tokenizers, scheduler, channel = stack
    stub = generation_pb2_grpc.GenerationStub(channel)
    reference = await record_stream(stub, greedy_request("Once upon a time", 8))
    # Each request takes the next tokenizer in turn for its detokenization (Encode calls keep
    # a turn of their own), so two of the four streams are pinned to each.
    running = [asyncio.Event() for _ in range(4)]
    streams = []
    for i, event in enumerate(running):
        streams.append(asyncio.create_task(record_stream(stub, greedy_request(f"The cat number {i}", 480),
                                                         on_delta=event)))
        await asyncio.wait_for(event.wait(), 30)  # admitted in this order
    port = tokenizers[0].port
    await tokenizers[0].stop(grace=0)
    stopped_at = time.monotonic()
    # Its two streams end with one Finished (error) naming it; the other two run to their end.
    records = await asyncio.wait_for(asyncio.gather(*streams), 60)
    assert sorted(r.finish_reason for r in records) == ["error", "error", "length", "length"]
    for record in records:
        assert record.code == grpc.StatusCode.OK and record.kinds().count("finished") == 1
        if record.finish_reason == "error":
            assert record.finished.error_message == TOKENIZER_LOST  # no address: it reaches clients
            assert record.ended_at - stopped_at < 5
    assert await health_status(channel, "tokenmill.v1.Generation") == SERVING
    for _ in range(4):  # every new request goes to the tokenizer that is left
        record = await record_stream(stub, greedy_request("Once upon a time", 8))
        assert record.token_ids == reference.token_ids

    # The other one goes too: NOT_SERVING, and new requests are told to retry.
    port1 = tokenizers[1].port
    await tokenizers[1].stop(grace=0)
    await wait_health(channel, NOT_SERVING)
    record = await record_stream(stub, greedy_request("Once upon a time", 8))
    assert record.code == grpc.StatusCode.UNAVAILABLE and "retry shortly" in record.details, record.details

    # Both come back on their ports: SERVING again, and requests use both.
    tokenizers[0] = await serve_tokenizer(TokenizerConfig(port=port, model=str(STORIES_DIR)))
    tokenizers[1] = await serve_tokenizer(TokenizerConfig(port=port1, model=str(STORIES_DIR)))
    await wait_health(channel, SERVING)
    deadline = time.monotonic() + 5
    while not all(link.connected for link in scheduler.app.tokenizers.links):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    for _ in range(4):
        record = await record_stream(stub, greedy_request("Once upon a time", 8))
        assert record.token_ids == reference.token_ids
