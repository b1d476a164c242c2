"""Several executors behind one scheduler, as real processes under the Launcher.

Requests spread over the executors; greedy and seeded streams equal the one-executor
in-process engine's, with preemption (small KV pools), prefix caching and speculation on;
every executor's KV is back to zero after each test. An executor SIGKILLed under 32 streams
loses nothing: its streams move to the survivor and finish exactly as undisturbed ones. With
every executor gone, each stream ends with exactly one Finished (error) once the wait for an
executor (--executor-wait-s) is over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
import torch

from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.common.server import create_channel
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.request.stop import StopConditions
from services.stack.client import build_request
from services.stack.launcher import LaunchConfig, Launcher
from tests.helpers.engine_runs import generate_all
from tests.helpers.service_harness import REPO_ROOT, STORIES_DIR
from tests.helpers.stack_streams import StreamRecord, record_stream

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

BLOCK_SIZE = 16
NUM_BLOCKS = 40
"""640 tokens a pool: 16 streams of ~100 tokens preempt each other on two executors."""
EXECUTOR_FLAGS = dict(dtype="fp32", device="cpu", attention_backend="torch")
MAX_TOKENS = 96
WAIT_S = 3.0
"""--executor-wait-s: how long streams wait once no executor is left."""
SHARED = "Once upon a time, in a small village by the sea, there lived a little girl named Lily. "
PROMPTS = [SHARED + f"One day number {i}" for i in range(8)] + [f"The cat number {i} sat" for i in range(8)]
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
GREEDY = SamplingParams(temperature=0.0)


def request_for(prompt: str, sampling: SamplingParams, max_tokens: int = MAX_TOKENS) -> generation_pb2.GenerateRequest:
    return build_request(prompt, max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                         seed=sampling.seed, ignore_eos=True)


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, str], list[int]]:
    """One executor, in process: (prompt, greedy|seeded) -> tokens."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(EngineConfig(ExecutorConfig(model=str(STORIES_DIR), block_size=BLOCK_SIZE, num_blocks=512,
                                                    **EXECUTOR_FLAGS)))
        stop = StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True)
        out = {}
        for name, sampling in (("greedy", GREEDY), ("seeded", SEEDED)):
            for prompt, delta in zip(PROMPTS, generate_all(engine, PROMPTS, sampling, stop)):
                out[(prompt, name)] = delta.token_ids
        return out
    finally:
        torch.set_num_threads(previous)


def launch(tmp_path_factory, executors: int) -> Launcher:
    log_dir = tmp_path_factory.mktemp(f"executors_{executors}")
    executor_args = [f"--num-blocks={NUM_BLOCKS}", f"--block-size={BLOCK_SIZE}"] + [
        f"--{name.replace('_', '-')}={value}" for name, value in EXECUTOR_FLAGS.items()]
    launcher = Launcher(LaunchConfig(
        model=str(STORIES_DIR), public_port=0, executor_args=executor_args, executor_roles=["mixed"] * executors,
        scheduler_args=["--num-speculative-tokens=3", f"--executor-wait-s={WAIT_S}"],
        drafter_args=["--num-speculative-tokens=3"], log_dir=str(log_dir), start_timeout_s=120, restart=False,
        env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}))
    launcher.start()
    return launcher


@pytest_asyncio.fixture(loop_scope="module", scope="module", params=[2, 3], ids=["2-executors", "3-executors"])
async def stack(request, tmp_path_factory) -> AsyncIterator[tuple[Launcher, generation_pb2_grpc.GenerationStub]]:
    launcher = await asyncio.to_thread(launch, tmp_path_factory, request.param)
    try:
        async with create_channel(launcher.public_address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            await speculation_engaged(stub)
            yield launcher, stub
    finally:
        await asyncio.to_thread(launcher.stop)


async def speculation_engaged(stub) -> None:
    """The drafter connects in the background: wait until drafts are being accepted."""
    deadline = time.monotonic() + 60
    # Stories260K repeats itself about birds: the n-gram drafter finds its own output.
    repetitive = "One day, Lily saw a bird. The bird was red. Lily saw a bird. The bird was red. Lily saw"
    while (await profile(stub)).spec_acceptance_rate == 0:
        assert time.monotonic() < deadline, "no draft was ever accepted"
        await record_stream(stub, request_for(repetitive, GREEDY, max_tokens=32))


async def profile(stub) -> generation_pb2.LatencyProfile:
    return await stub.GetProfile(generation_pb2.GetProfileRequest(), timeout=10)


async def wait_all_idle(stub, executors: int) -> None:
    """Every executor back to no request and no KV block held."""
    deadline = time.monotonic() + 10
    while True:
        reply = await profile(stub)
        idle = [(e.num_running, e.num_waiting, e.kv_cache_usage) == (0, 0, 0.0) for e in reply.executors]
        if len(idle) == executors and all(idle):
            return
        assert time.monotonic() < deadline, reply
        await asyncio.sleep(0.1)


def assert_complete(record: StreamRecord, expected: list[int]) -> None:
    assert record.code == grpc.StatusCode.OK, record.details
    assert record.kinds().count("finished") == 1 and record.finish_reason == "length", record.finished
    assert record.token_ids == expected


async def test_greedy_and_seeded_streams_equal_one_executor_and_every_pool_empties(stack, references) -> None:
    launcher, stub = stack
    executors = len(launcher.executor_names)
    calls = [record_stream(stub, request_for(prompt, sampling))
             for name, sampling in (("greedy", GREEDY), ("seeded", SEEDED)) for prompt in PROMPTS]
    records = await asyncio.gather(*calls)
    expected = [references[(prompt, name)] for name in ("greedy", "seeded") for prompt in PROMPTS]
    for record, tokens in zip(records, expected):
        assert_complete(record, tokens)
    reply = await profile(stub)
    assert len(reply.executors) == executors
    await wait_all_idle(stub, executors)


async def test_a_killed_executor_loses_no_stream(stack, references) -> None:
    launcher, stub = stack
    executors = len(launcher.executor_names)
    prompts = (PROMPTS * 2)[:32]
    running = [asyncio.Event() for _ in prompts]
    streams = [asyncio.create_task(record_stream(stub, request_for(p, GREEDY), on_delta=event))
               for p, event in zip(prompts, running)]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in running)), 60)
    launcher.services[launcher.executor_names[-1]].process.kill()  # SIGKILL, mid-flight
    records = await asyncio.wait_for(asyncio.gather(*streams), 120)
    for prompt, record in zip(prompts, records):
        assert_complete(record, references[(prompt, "greedy")])
    await wait_all_idle(stub, executors - 1)  # no block leaked on the survivors


async def test_with_every_executor_gone_each_stream_ends_with_one_error(stack) -> None:
    launcher, stub = stack
    streams = [asyncio.create_task(record_stream(stub, request_for(p, GREEDY, max_tokens=400))) for p in PROMPTS[:4]]
    await asyncio.sleep(0.5)
    for name in launcher.executor_names:
        process = launcher.services[name].process
        if process.poll() is None:
            process.kill()
    killed_at = time.monotonic()
    records = await asyncio.wait_for(asyncio.gather(*streams), WAIT_S + 30)
    for record in records:
        assert record.code == grpc.StatusCode.OK, record.details
        assert record.kinds().count("finished") == 1 and record.finish_reason == "error", record.finished
        assert "no executor came back" in record.finished.error_message
        assert record.ended_at - killed_at < WAIT_S + 10
