"""The stack as `tokenmill up` runs it: four real processes under the Launcher.

A request succeeds; an executor killed with SIGKILL mid-stream ends the affected streams with
UNAVAILABLE within seconds, the launcher restarts it on the same port and the scheduler
reconnects on its own; stopping the launcher with streams in flight ends every one of them
with Finished or UNAVAILABLE, none hangs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
import torch

from services.stack.launcher import LaunchConfig, Launcher
from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.common.stop import StopConditions
from services.common.server import create_channel
from services.tokenizer.text_tokenizer import TextTokenizer
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from tests.helpers.service_harness import REPO_ROOT, STORIES_DIR
from tests.helpers.stack_streams import StreamRecord, assert_framed, continuation_text, greedy_request, record_stream

# slow: starts the four services as processes and kills some
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

BLOCK_SIZE = 16
NUM_BLOCKS = 512
EXECUTOR_FLAGS = dict(dtype="fp32", device="cpu", attention_backend="torch")
PROMPT = "Once upon a time"
MAX_TOKENS = 16
FAILURE_WITHIN_S = 5.0
"""A stream whose executor died must end within this long (its client deadline is 60 s)."""
RECONNECT_WITHIN_S = 30.0
SHUTDOWN_GRACE_S = 0.5


@pytest.fixture(scope="module")
def launcher(tmp_path_factory) -> Launcher:
    log_dir = tmp_path_factory.mktemp("stack_logs")
    executor_args = [f"--num-blocks={NUM_BLOCKS}", f"--block-size={BLOCK_SIZE}"] + [
        f"--{name.replace('_', '-')}={value}" for name, value in EXECUTOR_FLAGS.items()]
    launcher = Launcher(LaunchConfig(
        model=str(STORIES_DIR), public_port=0, executor_args=executor_args,
        scheduler_args=[f"--shutdown-grace-seconds={SHUTDOWN_GRACE_S}"], log_dir=str(log_dir), start_timeout_s=60,
        # One OpenMP thread per process: four processes share a small CPU; the reference
        # engine below runs with the same setting.
        env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "TOKENMILL_LOG_LEVEL": "info"}))
    launcher.start()
    yield launcher
    launcher.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stub(launcher: Launcher) -> AsyncIterator[generation_pb2_grpc.GenerationStub]:
    async with create_channel(launcher.public_address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def reference_ids() -> list[int]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(EngineConfig(ExecutorConfig(model=str(STORIES_DIR), block_size=BLOCK_SIZE,
                                                    num_blocks=NUM_BLOCKS, **EXECUTOR_FLAGS)))
        sampling, stop = SamplingParams(temperature=0.0), StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True)
        return engine.generate_all([PROMPT], sampling, stop)[0].token_ids
    finally:
        torch.set_num_threads(previous)


def greedy(prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> generation_pb2.GenerateRequest:
    return greedy_request(prompt, max_tokens)


def service_log(launcher: Launcher, name: str) -> str:
    return launcher.services[name].log_path.read_text(errors="replace")[-3000:]


async def start_running_streams(stub, n: int, max_tokens: int) -> list[asyncio.Task]:
    """n streams, returned once each has received a delta (all are mid-flight)."""
    running = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.create_task(record_stream(stub, greedy(f"The cat number {i}", max_tokens), on_delta=event))
             for i, event in enumerate(running)]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in running)), 30)
    return tasks


async def generate_once_back(launcher: Launcher, stub, deadline: float, *, while_down: str = "") -> StreamRecord:
    """Retry a greedy request until the stack answers it; until then each attempt must fail
    with UNAVAILABLE (and say `while_down`)."""
    while (record := await record_stream(stub, greedy(), timeout=RECONNECT_WITHIN_S)).code != grpc.StatusCode.OK:
        assert record.code == grpc.StatusCode.UNAVAILABLE and while_down in record.details, record.details
        assert time.monotonic() < deadline, (launcher.events, service_log(launcher, "scheduler"))
        await asyncio.sleep(0.1)
    return record


async def test_a_request_succeeds(launcher, stub, reference_ids) -> None:
    tokenizer = TextTokenizer.from_dir(STORIES_DIR)
    ids = tokenizer.encode(PROMPT)
    record = await record_stream(stub, greedy())
    assert_framed(record, prompt_tokens=len(ids))
    assert record.token_ids == reference_ids
    assert record.text == continuation_text(tokenizer, ids, reference_ids)
    assert launcher.events == []


async def test_executor_killed_mid_stream_fails_streams_fast_and_the_stack_recovers(
        launcher, stub, reference_ids) -> None:
    executor = launcher.services["executor"]
    old_pid, port = executor.process.pid, executor.port
    streams = await start_running_streams(stub, 4, max_tokens=400)
    killed_at = time.monotonic()
    executor.process.kill()  # SIGKILL: no goodbye on the step stream
    records: list[StreamRecord] = await asyncio.wait_for(asyncio.gather(*streams), FAILURE_WITHIN_S + 10)
    for record in records:
        assert record.code == grpc.StatusCode.UNAVAILABLE, (record.code, record.details, record.kinds())
        assert record.ended_at - killed_at < FAILURE_WITHIN_S
        assert record.finished is None and 1 <= len(record.token_ids) < 400

    # The launcher restarts the executor on its old port; the scheduler reconnects in the
    # background and answers UNAVAILABLE until then.
    record = await generate_once_back(launcher, stub, time.monotonic() + RECONNECT_WITHIN_S)
    assert record.token_ids == reference_ids
    assert executor.restarts == 1 and executor.process.pid != old_pid and executor.port == port
    assert "executor restarted" in launcher.events


async def test_executor_killed_while_idle_is_reconnected_before_a_request_needs_it(
        launcher, stub, reference_ids) -> None:
    # With no step in flight, the scheduler must learn of the dead session from the stream
    # itself: a request arriving after the restart must not be sent into the dead stream
    # (it may only be told to retry while the scheduler reconnects).
    executor = launcher.services["executor"]
    restarted = launcher.events.count("executor restarted")
    await asyncio.sleep(0.5)  # the previous test's last step is long done
    executor.process.kill()
    deadline = time.monotonic() + RECONNECT_WITHIN_S
    while launcher.events.count("executor restarted") == restarted:
        assert time.monotonic() < deadline, launcher.events
        await asyncio.sleep(0.05)
    record = await generate_once_back(launcher, stub, deadline, while_down="is unavailable; retry shortly")
    assert record.token_ids == reference_ids


async def test_stopping_with_streams_in_flight_ends_every_stream(launcher, stub) -> None:
    # Short streams finish within the scheduler's shutdown grace, long ones cannot: both
    # kinds must end, each with Finished or UNAVAILABLE.
    short = await start_running_streams(stub, 3, max_tokens=24)
    long = await start_running_streams(stub, 3, max_tokens=480)
    scheduler = launcher.services["scheduler"].process
    stopped_at = time.monotonic()
    await asyncio.to_thread(launcher.stop)
    records = await asyncio.wait_for(asyncio.gather(*short, *long), 15)
    for max_tokens, record in zip([24] * 3 + [480] * 3, records):
        assert record.started is not None
        if record.code == grpc.StatusCode.OK:
            assert record.finish_reason == "length" and len(record.token_ids) == max_tokens
        else:
            assert record.code == grpc.StatusCode.UNAVAILABLE, (record.code, record.details)
            assert record.finished is None
        assert record.ended_at - stopped_at < SHUTDOWN_GRACE_S + 5
    assert [r.code for r in records[3:]] == [grpc.StatusCode.UNAVAILABLE] * 3, "480 tokens within the grace?"
    assert scheduler.returncode == 0, service_log(launcher, "scheduler")
    assert all(svc.process.poll() is not None for svc in launcher.services.values())
