"""The executor's Step session cannot be held by a silent client (services/executor/step_guard.py):
a session that sends nothing for step_idle_timeout_s is ended with DEADLINE_EXCEEDED and the
next one starts, while the scheduler's own idle session stays up on its heartbeats."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc
from services.common.server import create_channel, start_server
from services.executor import config as executor_config
from services.executor.servicer import ExecutorServicer
from services.scheduler.links import step_stream
from tests.executor.test_executor_service import SERVICE, BlockingRunner, decode_request
from tests.helpers.service_harness import StreamSession, expect_status
from tests.helpers.small_stack import start_small_stack
from tests.helpers.stack_streams import greedy_request, record_stream

IDLE_S = 0.6


async def test_a_silent_session_is_ended_and_the_next_one_starts():
    worker = ThreadPoolExecutor(max_workers=1)
    loaded = asyncio.get_running_loop().create_future()
    loaded.set_result(BlockingRunner())
    servicer = ExecutorServicer(worker, loaded, idle_timeout_s=IDLE_S)

    def register(server: grpc.aio.Server) -> list[str]:
        executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
        return [SERVICE]

    running = await start_server("executor", register, port=0)
    try:
        async with create_channel(running.address) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            holder = StreamSession(stub.Step)
            reply = await holder.exchange(executor_pb2.StepRequest(step_id=7))  # the handshake, then silence
            assert reply.step_id == 7
            second = StreamSession(stub.Step)
            details = await expect_status(second.exchange(decode_request(1, 3)), grpc.StatusCode.FAILED_PRECONDITION)
            assert "another Step stream" in details
            started = time.monotonic()
            assert await holder.call.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # it sent nothing more
            assert IDLE_S * 0.5 <= time.monotonic() - started < IDLE_S * 5
            third = StreamSession(stub.Step)
            assert (await third.exchange(executor_pb2.StepRequest(step_id=9))).step_id == 9
            assert await third.close() == grpc.StatusCode.OK
    finally:
        await running.stop(grace=0)
        worker.shutdown(wait=False)


async def test_the_schedulers_idle_session_stays_up_on_its_heartbeats(monkeypatch):
    monkeypatch.setattr(step_stream, "STEP_HEARTBEAT_S", IDLE_S / 4)
    monkeypatch.setattr(executor_config, "MIN_STEP_IDLE_TIMEOUT_S", IDLE_S)  # three heartbeats, scaled down
    # Two executors: the scheduler keeps a session on each, each heartbeats on its own.
    stack = await start_small_stack(executor_overrides=dict(step_idle_timeout_s=IDLE_S), executors=2)
    try:
        links = list(stack.scheduler.app.executors.values())
        sessions = [link._stream for link in links]
        assert len(links) == 2 and all(sessions)
        await asyncio.sleep(4 * IDLE_S)  # idle: nothing to plan, only heartbeats
        assert [link._stream for link in links] == sessions, "an idle session was ended (and reconnected)"
        records = await asyncio.gather(*(record_stream(stack.stub, greedy_request(p, 8))
                                         for p in ("Once upon a time", "The cat", "Lily wanted")))
        assert all(r.code == grpc.StatusCode.OK and len(r.token_ids) == 8 for r in records)
        assert [link._stream for link in links] == sessions
    finally:
        await stack.stop()


def test_a_window_groups_table_may_repeat_placeholders_behind_its_window_only():
    """Tables of three KV groups (full, window 6, window 6), blocks of 4: a prefix hit of 16 tokens
    reads the window groups' blocks from the third on; entries before are placeholders (0)."""
    import pytest

    from services.common.errors import InvalidArgumentError
    from services.common.sampling_params import SamplingParams
    from services.common.step import ExecutorInfo, NewSequence, StepPlan
    from services.executor.step_guard import check_plan

    info = ExecutorInfo(num_blocks=64, block_size=4, max_model_len=64, vocab_size=100, dtype="float32", device="cpu",
                        attention_backend="torch", model="m", architecture="Gemma3ForCausalLM", bos_token_id=None,
                        eos_token_ids=(), kv_group_windows=(0, 6, 6))

    def plan(table: list[int]) -> StepPlan:
        return StepPlan(1, new=[NewSequence(1, list(range(18)), 18, 16, 2, table, SamplingParams())])

    hit = [1, 0, 0, 2, 0, 0, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # 5 rows: 18 tokens
    check_plan(plan(hit), info)
    with pytest.raises(InvalidArgumentError, match="names a block twice"):
        check_plan(plan(hit[:-1] + [4]), info)
    with pytest.raises(InvalidArgumentError, match="18 tokens need 15"):
        check_plan(plan(hit[:-3]), info)
