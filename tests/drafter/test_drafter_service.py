"""The drafter service over loopback: Propose streams against NgramProposer run in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from services.common.pb.tokenmill.v1 import drafter_pb2
from services.common.server import RunningServer, create_channel
from services.drafter.config import DrafterConfig
from services.drafter.main import serve
from services.drafter.ngram import NgramProposer
from tests.helpers.drafts import drafts_of
from tests.helpers.service_harness import SERVING, StreamSession, expect_status, health_status, reflected_services, standard_services

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVICE = "tokenmill.v1.Drafter"
K = 3
PROPOSER = NgramProposer(max_ngram=3, min_ngram=1, num_speculative_tokens=K)

# Sequences with repetition for prompt lookup to find.
SEQ_A = [5, 6, 7, 8, 9, 5, 6, 7]          # suffix [5, 6, 7] occurred before: propose 8, 9, 5
SEQ_B = [1, 2, 3, 4, 1, 2]                # suffix [1, 2]: propose 3, 4, 1
SEQ_C = [10, 11, 12, 13]                  # no repetition: nothing


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server() -> AsyncIterator[RunningServer]:
    running = await serve(DrafterConfig(port=0, num_speculative_tokens=K, ngram_min=1, ngram_max=3))
    yield running
    await running.stop(grace=0)


async def test_info_health_and_reflection(server: RunningServer, stub) -> None:
    info = await stub.GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10)
    assert info == drafter_pb2.DrafterInfo(
        method=drafter_pb2.DRAFT_METHOD_NGRAM, num_speculative_tokens=K, ngram_min=1, ngram_max=3
    )
    async with create_channel(server.address) as channel:
        assert await health_status(channel) == SERVING
        assert await health_status(channel, SERVICE) == SERVING
        assert await reflected_services(channel) == standard_services(SERVICE)


async def test_propose_follows_the_ngram_proposer_step_by_step(stub) -> None:
    session = StreamSession(stub.Propose)
    known = {1: list(SEQ_A), 2: list(SEQ_B), 3: list(SEQ_C)}
    first = await session.exchange(drafter_pb2.ProposeRequest(
        step_id=1,
        new_sequences=[drafter_pb2.DraftSequence(seq_id=s, token_ids=t) for s, t in known.items()],
        propose_seq_ids=[3, 1, 2],  # the response follows this order
    ))
    assert first.step_id == 1 and list(first.seq_ids) == [3, 1, 2]
    assert drafts_of(first) == {3: [], 1: [8, 9, 5], 2: [3, 4, 1]}
    assert list(first.draft_counts) == [0, 3, 3]

    # Accepted tokens arrive as packed deltas; drafts for only some sequences; a smaller k.
    gained = {1: [8], 3: [10, 11]}
    for seq_id, tokens in gained.items():
        known[seq_id].extend(tokens)
    second = await session.exchange(drafter_pb2.ProposeRequest(
        step_id=2, seq_ids=list(gained), token_counts=[len(t) for t in gained.values()],
        token_ids=[t for tokens in gained.values() for t in tokens], propose_seq_ids=[1, 3],
        num_speculative_tokens=2,
    ))
    assert drafts_of(second) == {1: PROPOSER.propose_for(known[1])[:2], 3: PROPOSER.propose_for(known[3])[:2]}
    assert drafts_of(second) == {1: [9, 5], 3: [12, 13]}

    # More than the configured k is capped at k; a closed sequence is gone before drafting.
    third = await session.exchange(drafter_pb2.ProposeRequest(
        step_id=3, closed_seq_ids=[2], propose_seq_ids=[1, 3], num_speculative_tokens=10))
    assert drafts_of(third) == {1: PROPOSER.propose_for(known[1]), 3: PROPOSER.propose_for(known[3])}
    assert len(third.draft_token_ids) == 2 * K
    details = await expect_status(
        session.exchange(drafter_pb2.ProposeRequest(step_id=4, propose_seq_ids=[2])), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert details == "propose_seq_ids names 2, which is not open"


async def test_streams_are_independent_and_forget_on_close(stub) -> None:
    left, right = StreamSession(stub.Propose), StreamSession(stub.Propose)
    # The same sequence id holds different tokens in two concurrent streams.
    a = await left.exchange(drafter_pb2.ProposeRequest(
        step_id=1, new_sequences=[drafter_pb2.DraftSequence(seq_id=1, token_ids=SEQ_A)], propose_seq_ids=[1]))
    b = await right.exchange(drafter_pb2.ProposeRequest(
        step_id=1, new_sequences=[drafter_pb2.DraftSequence(seq_id=1, token_ids=SEQ_B)], propose_seq_ids=[1]))
    assert drafts_of(a) == {1: [8, 9, 5]} and drafts_of(b) == {1: [3, 4, 1]}
    assert await left.close() == grpc.StatusCode.OK
    assert await right.close() == grpc.StatusCode.OK
    again = StreamSession(stub.Propose)
    details = await expect_status(
        again.exchange(drafter_pb2.ProposeRequest(step_id=1, propose_seq_ids=[1])), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert details == "propose_seq_ids names 1, which is not open"


@pytest.mark.parametrize(
    ("request_fields", "details"),
    [
        ({"new_sequences": [drafter_pb2.DraftSequence(seq_id=1, token_ids=[4])]},
         "new_sequences[0].seq_id 1 is already open"),
        ({"seq_ids": [1], "token_counts": [2], "token_ids": [4]}, "token_ids has 1 entries but token_counts sums to 2"),
        ({"seq_ids": [1], "token_counts": [], "token_ids": []},
         "token_counts has 0 entries; expected 1 (one per entry of seq_ids)"),
        ({"seq_ids": [8], "token_counts": [1], "token_ids": [4]}, "seq_ids names 8, which is not open"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens must be >= 0 (0 = the default), got -1"),
    ],
)
async def test_malformed_propose_message_ends_the_stream(stub, request_fields: dict, details: str) -> None:
    session = StreamSession(stub.Propose)
    opened = await session.exchange(drafter_pb2.ProposeRequest(
        step_id=1, new_sequences=[drafter_pb2.DraftSequence(seq_id=1, token_ids=SEQ_A)]))
    assert opened.step_id == 1 and list(opened.seq_ids) == []
    got = await expect_status(
        session.exchange(drafter_pb2.ProposeRequest(step_id=2, **request_fields)), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert got == details
