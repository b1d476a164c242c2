"""The stack as `tokenmill up` runs it: four real processes under the Launcher.

A request succeeds; an executor killed with SIGKILL mid-stream pauses the streams, which go
on once the launcher has restarted it and finish exactly as undisturbed ones (the scheduler
knows every token and recomputes what the executor lost); a tokenizer killed mid-stream ends
the affected streams within seconds, each with exactly one Finished (reason error, the cause
named), never a bare UNAVAILABLE after partial output; health says NOT_SERVING while the
backend is away; the launcher restarts it on the same port and the scheduler reconnects on its
own, so requests succeed again within 5 s of the restart; stopping the launcher with streams
in flight ends every one of them with Finished, none hangs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
import torch

from services.scheduler.link_keeper import TOKENIZER_LOST
from services.stack.launcher import LaunchConfig, Launcher, health_status
from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.common.server import create_channel
from services.tokenizer.text_tokenizer import TextTokenizer
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from tests.helpers.service_harness import REPO_ROOT, STORIES_DIR
from tests.helpers.stack_streams import StreamRecord, assert_framed, continuation_text, greedy_request, record_stream
from tests.helpers.engine_runs import generate_all

# slow: starts the four services as processes and kills some
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

BLOCK_SIZE = 16
NUM_BLOCKS = 512
EXECUTOR_FLAGS = dict(dtype="fp32", device="cpu", attention_backend="torch")
PROMPT = "Once upon a time"
MAX_TOKENS = 16
RUNNING_TOKENS = 300
"""Tokens of the streams a kill interrupts: long enough to be mid-flight when it comes."""
FAILURE_WITHIN_S = 5.0
"""A stream whose executor died must end within this long (its client deadline is 60 s)."""
RECONNECT_WITHIN_S = 30.0
BACK_AFTER_RESTART_S = 5.0
"""New requests succeed within this long of a killed backend's restart (issue target)."""
HEALTH_SERVICES = ("", "tokenmill.v1.Generation")
SHUTDOWN_GRACE_S = 0.05  # under what 480 tokens take at the fastest a 2-core machine streams (~5,000 tok/s)


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
        return generate_all(engine, [PROMPT], sampling, stop)[0].token_ids
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def running_references() -> list[list[int]]:
    """Solo greedy tokens of the streams the executor kill interrupts."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(EngineConfig(ExecutorConfig(model=str(STORIES_DIR), block_size=BLOCK_SIZE,
                                                    num_blocks=NUM_BLOCKS, **EXECUTOR_FLAGS)))
        sampling = SamplingParams(temperature=0.0)
        stop = StopConditions(max_tokens=RUNNING_TOKENS, ignore_eos=True)
        return [d.token_ids for d in generate_all(engine, [running_prompt(i) for i in range(4)], sampling, stop)]
    finally:
        torch.set_num_threads(previous)


def greedy(prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> generation_pb2.GenerateRequest:
    return greedy_request(prompt, max_tokens)


def service_log(launcher: Launcher, name: str) -> str:
    return launcher.services[name].log_path.read_text(errors="replace")[-3000:]


def running_prompt(i: int) -> str:
    return f"The cat number {i}"


async def start_running_streams(stub, n: int, max_tokens: int) -> list[asyncio.Task]:
    """n streams, returned once each has received a delta (all are mid-flight)."""
    running = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.create_task(record_stream(stub, greedy(running_prompt(i), max_tokens), on_delta=event))
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


def assert_ended_with_error(record: StreamRecord, killed_at: float, cause: str, max_tokens: int) -> None:
    """Partial output, then exactly one Finished with reason error naming the cause; status OK."""
    assert record.code == grpc.StatusCode.OK, (record.code, record.details, record.kinds())
    kinds = record.kinds()
    assert kinds[0] == "started" and kinds.count("finished") == 1 and kinds[-1] == "finished", kinds
    assert record.finish_reason == "error", record.finished
    assert cause in record.finished.error_message, record.finished.error_message
    assert "already finished" not in record.finished.error_message
    assert record.finished.usage.completion_tokens == len(record.token_ids)
    assert 1 <= len(record.token_ids) < max_tokens
    assert record.ended_at - killed_at < FAILURE_WITHIN_S


async def health(launcher: Launcher) -> set[str]:
    """The scheduler's health for "" and the Generation service."""
    return {await asyncio.to_thread(health_status, launcher.public_address, name, 1.0) for name in HEALTH_SERVICES}


async def wait_restarted(launcher: Launcher, name: str, before: int, *, saw_not_serving: list[bool]) -> float:
    """Wait for the launcher's restart of `name`; poll the scheduler's health meanwhile and
    record whether it said NOT_SERVING (for both names). Returns when the restart was seen."""
    deadline = time.monotonic() + RECONNECT_WITHIN_S
    while launcher.events.count(f"{name} restarted") == before:
        assert time.monotonic() < deadline, launcher.events
        if await health(launcher) == {"NOT_SERVING"}:
            saw_not_serving.append(True)
        await asyncio.sleep(0.02)
    return time.monotonic()


async def wait_serving(launcher: Launcher, deadline: float) -> None:
    while await health(launcher) != {"SERVING"}:
        assert time.monotonic() < deadline, (launcher.events, service_log(launcher, "scheduler"))
        await asyncio.sleep(0.05)


async def test_a_request_succeeds(launcher, stub, reference_ids) -> None:
    tokenizer = TextTokenizer.from_dir(STORIES_DIR)
    ids = tokenizer.encode(PROMPT)
    record = await record_stream(stub, greedy())
    assert_framed(record, prompt_tokens=len(ids))
    assert record.token_ids == reference_ids
    assert record.text == continuation_text(tokenizer, ids, reference_ids)
    assert launcher.events == []


async def test_executor_killed_mid_stream_pauses_streams_that_then_finish_as_undisturbed(
        launcher, stub, reference_ids, running_references) -> None:
    executor = launcher.services["executor"]
    old_pid, port = executor.process.pid, executor.port
    streams = await start_running_streams(stub, 4, max_tokens=RUNNING_TOKENS)
    executor.process.kill()  # SIGKILL: no goodbye on the step stream

    # The launcher restarts the executor on its old port; the scheduler reconnects in the
    # background, says NOT_SERVING and refuses new requests with UNAVAILABLE until then, while
    # the streams in flight wait for it (SchedulerLimits.executor_wait_s).
    saw_not_serving: list[bool] = []
    restarted_at = await wait_restarted(launcher, "executor", 0, saw_not_serving=saw_not_serving)
    assert saw_not_serving, "health never said NOT_SERVING while the executor was away"
    records: list[StreamRecord] = await asyncio.wait_for(asyncio.gather(*streams), RECONNECT_WITHIN_S)
    for record, reference in zip(records, running_references):
        assert record.code == grpc.StatusCode.OK and record.kinds().count("finished") == 1, record.details
        assert (record.finish_reason, record.token_ids) == ("length", reference)
    record = await generate_once_back(launcher, stub, restarted_at + BACK_AFTER_RESTART_S)
    assert record.token_ids == reference_ids
    await wait_serving(launcher, time.monotonic() + 2)
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
    record = await generate_once_back(launcher, stub, deadline,
                                      while_down="executor is unavailable (restarting or unreachable); retry shortly")
    assert record.token_ids == reference_ids


async def test_tokenizer_killed_mid_stream_ends_streams_with_one_finished_and_the_stack_recovers(
        launcher, stub, reference_ids) -> None:
    # The tokenizer holds every stream's detokenization state: its streams end with one
    # Finished (error); health says NOT_SERVING until the restarted tokenizer is reconnected,
    # and new requests (text prompts, so Encode too) succeed within 5 s of its restart.
    tokenizer = launcher.services["tokenizer"]
    restarted = launcher.events.count("tokenizer restarted")
    streams = await start_running_streams(stub, 4, max_tokens=400)
    killed_at = time.monotonic()
    tokenizer.process.kill()
    saw_not_serving: list[bool] = []
    records = await asyncio.wait_for(asyncio.gather(*streams), FAILURE_WITHIN_S + 10)
    for record in records:
        # The client hears which backend went away, never where it listens (that is in the log).
        assert_ended_with_error(record, killed_at, TOKENIZER_LOST, 400)
    restarted_at = await wait_restarted(launcher, "tokenizer", restarted, saw_not_serving=saw_not_serving)
    assert saw_not_serving, "health never said NOT_SERVING while the tokenizer was away"
    record = await generate_once_back(launcher, stub, restarted_at + BACK_AFTER_RESTART_S)
    assert record.token_ids == reference_ids
    await wait_serving(launcher, time.monotonic() + 2)


async def test_tokenizer_killed_while_idle_is_reconnected(launcher, stub, reference_ids) -> None:
    tokenizer = launcher.services["tokenizer"]
    restarted = launcher.events.count("tokenizer restarted")
    tokenizer.process.kill()
    saw_not_serving: list[bool] = []
    restarted_at = await wait_restarted(launcher, "tokenizer", restarted, saw_not_serving=saw_not_serving)
    assert saw_not_serving, "health never said NOT_SERVING while the tokenizer was away"
    record = await generate_once_back(launcher, stub, restarted_at + BACK_AFTER_RESTART_S,
                                      while_down="is unavailable; retry shortly")
    assert record.token_ids == reference_ids


async def test_stopping_with_streams_in_flight_ends_every_stream(launcher, stub) -> None:
    # Short streams finish within the scheduler's shutdown grace, long ones cannot: both
    # kinds must end, each with exactly one Finished (length, or error: shutting down).
    short = await start_running_streams(stub, 3, max_tokens=24)
    long = await start_running_streams(stub, 3, max_tokens=480)
    scheduler = launcher.services["scheduler"].process
    stopped_at = time.monotonic()
    await asyncio.to_thread(launcher.stop)
    records = await asyncio.wait_for(asyncio.gather(*short, *long), 15)
    for max_tokens, record in zip([24] * 3 + [480] * 3, records):
        assert record.started is not None
        assert record.code == grpc.StatusCode.OK, (record.code, record.details)
        assert record.kinds().count("finished") == 1 and record.kinds()[-1] == "finished"
        if record.finish_reason == "length":
            assert len(record.token_ids) == max_tokens
        else:
            assert record.finish_reason == "error" and "shutting down" in record.finished.error_message
        assert record.ended_at - stopped_at < SHUTDOWN_GRACE_S + 5
    assert [r.finish_reason for r in records[3:]] == ["error"] * 3, "480 tokens within the grace?"
    assert scheduler.returncode == 0, service_log(launcher, "scheduler")
    assert all(svc.process.poll() is not None for svc in launcher.services.values())
