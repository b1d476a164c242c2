"""The drafter service with --method draft_model, over loopback: drafts against the target's
greedy decoding, partial acceptance through packed deltas, blocks freed by closing sequences
and streams, bad token ids, and the flags in a real process."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from services.common.pb.tokenmill.v1 import drafter_pb2, drafter_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.common.server import RunningServer, create_channel
from services.scheduler.request.stop import StopConditions
from services.drafter.config import DraftModelSettings, DrafterConfig
from services.drafter.main import serve
from services.drafter.proposer import DraftMethod
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from tests.helpers.drafts import drafts_of
from tests.helpers.service_harness import (
    SERVING, StreamSession, expect_status, health_status, launch_module, wait_for_port_file,
)
from tests.helpers.engine_runs import generate_all

pytestmark = pytest.mark.asyncio(loop_scope="module")

K = 3
NUM_BLOCKS = 64  # 1024 slots of 16


@pytest.fixture(scope="module")
def engine(stories_dir) -> Engine:
    return Engine(EngineConfig(ExecutorConfig(model=str(stories_dir), dtype="float32", device="cpu", num_blocks=256)))


def target_greedy(engine: Engine, prompt: list[int], k: int = K) -> list[int]:
    (out,) = generate_all(engine, [prompt], SamplingParams(temperature=0.0), StopConditions(max_tokens=k, ignore_eos=True))
    return out.token_ids


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(stories_dir) -> AsyncIterator[RunningServer]:
    running = await serve(DrafterConfig(
        port=0, method=DraftMethod.DRAFT_MODEL, num_speculative_tokens=K, draft=DraftModelSettings(
            draft_model=str(stories_dir), target_model=str(stories_dir), device="cpu", num_blocks=NUM_BLOCKS)))
    yield running
    await running.stop(grace=0)


def opening(step_id: int, sequences: dict[int, list[int]], propose: list[int]) -> drafter_pb2.ProposeRequest:
    return drafter_pb2.ProposeRequest(
        step_id=step_id, new_sequences=[drafter_pb2.DraftSequence(seq_id=s, token_ids=t) for s, t in sequences.items()],
        propose_seq_ids=propose)


async def test_info_reports_the_draft_model(server, stub, stories_dir) -> None:
    info = await stub.GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10)
    assert info == drafter_pb2.DrafterInfo(method=drafter_pb2.DRAFT_METHOD_DRAFT_MODEL, num_speculative_tokens=K,
                                           draft_model_path=str(stories_dir), vocab_size=512)
    async with create_channel(server.address) as channel:
        assert await health_status(channel, "tokenmill.v1.Drafter") == SERVING


async def test_drafts_follow_the_targets_greedy_decoding_across_partial_acceptance(stub, engine) -> None:
    (story,) = [target_greedy(engine, [1], k=60)]
    known = {7: [1] + story[:20], 8: [1] + story[:45], 9: [1, 300, 301, 302]}
    session = StreamSession(stub.Propose)
    reply = await session.exchange(opening(1, known, [9, 7, 8]))
    assert reply.step_id == 1 and list(reply.seq_ids) == [9, 7, 8]
    drafts = drafts_of(reply)
    assert drafts == {s: target_greedy(engine, t) for s, t in known.items()}
    for step_id in range(2, 6):
        # Sequence 7 accepts everything plus a bonus, 8 accepts one draft and is corrected, 9 accepts none.
        gained = {7: drafts[7] + [drafts[7][0]], 8: drafts[8][:1] + [(drafts[8][1] + 1) % 512],
                  9: [(drafts[9][0] + 5) % 512]}
        for seq_id, tokens in gained.items():
            known[seq_id] += tokens
        reply = await session.exchange(drafter_pb2.ProposeRequest(
            step_id=step_id, seq_ids=list(gained), token_counts=[len(t) for t in gained.values()],
            token_ids=[t for tokens in gained.values() for t in tokens], propose_seq_ids=[7, 8, 9]))
        drafts = drafts_of(reply)
        assert drafts == {s: target_greedy(engine, t) for s, t in known.items()}, f"step {step_id}"
    # A smaller k per message; a closed sequence is gone before drafting.
    reply = await session.exchange(drafter_pb2.ProposeRequest(
        step_id=6, closed_seq_ids=[9], propose_seq_ids=[8], num_speculative_tokens=1))
    assert drafts_of(reply) == {8: drafts[8][:1]}
    details = await expect_status(
        session.exchange(drafter_pb2.ProposeRequest(step_id=7, propose_seq_ids=[9])), grpc.StatusCode.INVALID_ARGUMENT)
    assert details == "propose_seq_ids names 9, which is not open"


async def test_closing_sequences_and_streams_frees_the_pool(stub) -> None:
    long = [5 + i % 400 for i in range(500)]  # 500 tokens + 2 fed drafts: 32 blocks, half the pool
    first = StreamSession(stub.Propose)
    reply = await first.exchange(opening(1, {1: long, 2: long, 3: long}, [1, 2, 3]))
    assert [len(d) for d in drafts_of(reply).values()] == [K, K, 0]  # the pool is full for the third
    reply = await first.exchange(drafter_pb2.ProposeRequest(step_id=2, closed_seq_ids=[1], propose_seq_ids=[3]))
    assert len(drafts_of(reply)[3]) == K
    assert await first.close() == grpc.StatusCode.OK
    # The ended stream's blocks are free for the next one.
    second = StreamSession(stub.Propose)
    reply = await second.exchange(opening(1, {1: long, 2: long}, [2, 1]))
    assert [len(d) for d in drafts_of(reply).values()] == [K, K]
    assert await second.close() == grpc.StatusCode.OK


@pytest.mark.parametrize(("request_fields", "details"), [
    ({"new_sequences": [drafter_pb2.DraftSequence(seq_id=2, token_ids=[1, 512])]},
     "sequence 2: token id 512 is outside the draft model's vocabulary [0, 512)"),
    ({"seq_ids": [1], "token_counts": [1], "token_ids": [9000]},
     "sequence 1: token id 9000 is outside the draft model's vocabulary [0, 512)"),
    ({"propose_seq_ids": [1, 1]}, "propose_seq_ids names 1 twice"),
])
async def test_malformed_messages_end_the_stream_by_name(stub, request_fields: dict, details: str) -> None:
    session = StreamSession(stub.Propose)
    await session.exchange(opening(1, {1: [1, 2, 3]}, []))
    got = await expect_status(
        session.exchange(drafter_pb2.ProposeRequest(step_id=2, **request_fields)), grpc.StatusCode.INVALID_ARGUMENT)
    assert got == details


@pytest.mark.timeout(90)
async def test_flags_start_a_self_speculative_drafter_process(tmp_path: Path, stories_dir) -> None:
    port_file = tmp_path / "drafter.port"
    process = await launch_module("services.drafter", [
        "--port", "0", "--port-file", str(port_file), "--allow-unauthenticated", "--method", "draft_model", "--draft-model", str(stories_dir),
        "--draft-layers", "2", "--num-speculative-tokens", "2", "--device", "cpu", "--num-blocks", "8"])
    try:
        port = await wait_for_port_file(port_file, process, timeout=60)
        async with create_channel(f"127.0.0.1:{port}") as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            info = await stub.GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=10)
            assert (info.method, info.num_speculative_tokens, info.vocab_size) == (
                drafter_pb2.DRAFT_METHOD_DRAFT_MODEL, 2, 512)
            session = StreamSession(stub.Propose)
            reply = await session.exchange(opening(1, {1: [1, 403, 407]}, [1]))
            assert list(reply.draft_counts) == [2]
            assert await session.close() == grpc.StatusCode.OK
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=20) == 0
        assert b"draft_model_loaded" in await process.stderr.read()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_the_launcher_passes_drafter_flags_and_the_target(stories_dir) -> None:
    from services.common.settings import parse_config
    from services.stack.launcher import LaunchConfig, Launcher

    launcher = Launcher(LaunchConfig(model=str(stories_dir), drafter_args=[
        "--method=draft_model", f"--draft-model={stories_dir}", "--draft-layers=2"]))
    command = launcher.command("drafter")
    assert command[1:3] == ["-m", "services.drafter"]
    config = parse_config(DrafterConfig, command[3:], env={})
    assert (config.method, config.draft.draft_model, config.draft.draft_layers, config.draft.target_model) == (
        DraftMethod.DRAFT_MODEL, str(stories_dir), 2, str(stories_dir))
    config.validate()
    # An n-gram drafter is told the target too and ignores it.
    plain = parse_config(DrafterConfig, Launcher(LaunchConfig(model=str(stories_dir))).command("drafter")[3:],
                         env={})
    assert plain.method is DraftMethod.NGRAM and plain.draft.target_model == str(stories_dir)
