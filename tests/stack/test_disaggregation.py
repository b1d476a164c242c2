"""Prefill/decode disaggregation as real processes: one prefill and one decode executor.

Every prompt is computed on the prefill executor and continues on the decode executor, its
KV blocks copied between them: greedy streams equal the colocated in-process engine's, the
bytes moved are exactly the prompts' blocks (bytes_per_block each, int8 KV included), a copy
that cannot be made (pools of different layouts) falls back to recomputing with the same
output, and the prefill executor SIGKILLed mid-run loses no stream.
"""

from __future__ import annotations

import asyncio
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
from services.tokenizer.text_tokenizer import TextTokenizer
from tests.helpers.engine_runs import generate_all
from tests.helpers.service_harness import REPO_ROOT, STORIES_DIR
from tests.helpers.stack_streams import record_stream

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

BLOCK_SIZE = 16
MAX_TOKENS = 48
EXECUTOR_FLAGS = dict(dtype="fp32", device="cpu", attention_backend="torch")
# Distinct prompts (no shared full block), so every block of every prompt is copied.
PROMPTS = [f"{i} little birds sat on a tree and sang" + " la" * (i * 5) for i in range(8)]


def reference(kv_cache_dtype: str) -> list[list[int]]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(EngineConfig(ExecutorConfig(model=str(STORIES_DIR), block_size=BLOCK_SIZE, num_blocks=512,
                                                    kv_cache_dtype=kv_cache_dtype, **EXECUTOR_FLAGS)))
        stop = StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True)
        return [d.token_ids for d in generate_all(engine, PROMPTS, SamplingParams(temperature=0.0), stop)]
    finally:
        torch.set_num_threads(previous)


def launch(log_dir, kv_cache_dtype: str, decode_args: list[str] = ()) -> Launcher:
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in EXECUTOR_FLAGS.items()]
    launcher = Launcher(LaunchConfig(
        model=str(STORIES_DIR), public_port=0, executor_roles=["prefill", "decode"],
        executor_args=flags + ["--num-blocks=256", f"--block-size={BLOCK_SIZE}", f"--kv-cache-dtype={kv_cache_dtype}"],
        executor_role_args={"decode": list(decode_args)}, log_dir=str(log_dir), start_timeout_s=120, restart=False,
        env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}))
    launcher.start()
    return launcher


@pytest_asyncio.fixture(loop_scope="module", scope="module", params=["auto", "int8"])
async def stack(request, tmp_path_factory) -> AsyncIterator[tuple[Launcher, generation_pb2_grpc.GenerationStub, str]]:
    launcher = await asyncio.to_thread(launch, tmp_path_factory.mktemp(f"pd_{request.param}"), request.param)
    try:
        async with create_channel(launcher.public_address) as channel:
            yield launcher, generation_pb2_grpc.GenerationStub(channel), request.param
    finally:
        await asyncio.to_thread(launcher.stop)


def greedy(prompt: str) -> generation_pb2.GenerateRequest:
    return build_request(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


async def run_all(stub) -> list[list[int]]:
    records = await asyncio.gather(*(record_stream(stub, greedy(p)) for p in PROMPTS))
    for record in records:
        assert record.code == grpc.StatusCode.OK and record.finish_reason == "length", (record.code, record.details)
    return [r.token_ids for r in records]


async def executors(stub) -> dict[str, generation_pb2.ExecutorProfile]:
    reply = await stub.GetProfile(generation_pb2.GetProfileRequest(), timeout=10)
    return {e.role: e for e in reply.executors}


async def test_streams_equal_colocated_and_the_bytes_moved_are_the_prompts_blocks(stack) -> None:
    launcher, stub, kv_cache_dtype = stack
    assert await run_all(stub) == await asyncio.to_thread(reference, kv_cache_dtype)
    info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    block_bytes = info.kv_cache_bytes // info.num_kv_blocks
    tokenizer = TextTokenizer.from_dir(STORIES_DIR)
    blocks = sum(-(-len(tokenizer.encode(p)) // BLOCK_SIZE) for p in PROMPTS)
    decode = (await executors(stub))["decode"]
    assert (decode.kv_transfers, decode.kv_transfer_failures) == (len(PROMPTS), 0)
    assert decode.kv_transfer_bytes == blocks * block_bytes
    everyone = await executors(stub)
    assert all((e.num_running, e.num_waiting, e.kv_cache_usage) == (0, 0, 0.0) for e in everyone.values())


async def test_the_prefill_executor_killed_mid_run_loses_no_stream(stack) -> None:
    launcher, stub, kv_cache_dtype = stack
    expected = await asyncio.to_thread(reference, kv_cache_dtype)
    running = [asyncio.Event() for _ in PROMPTS]
    streams = [asyncio.create_task(record_stream(stub, greedy(p), on_delta=event)) for p, event in zip(PROMPTS, running)]
    await asyncio.wait_for(running[0].wait(), 60)  # the first prompts are handed over, the others still wait
    launcher.services["executor"].process.kill()  # the prefill executor (the first one)
    records = await asyncio.wait_for(asyncio.gather(*streams), 120)
    for record, tokens in zip(records, expected):
        assert record.code == grpc.StatusCode.OK and record.finish_reason == "length", record.details
        assert record.token_ids == tokens


async def test_pools_of_different_layouts_recompute_with_the_same_output(tmp_path) -> None:
    launcher = await asyncio.to_thread(launch, tmp_path, "auto", ["--block-size=32"])
    try:
        async with create_channel(launcher.public_address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            assert await run_all(stub) == await asyncio.to_thread(reference, "auto")
            decode = (await executors(stub))["decode"]
            assert (decode.kv_transfers, decode.kv_transfer_failures) == (0, len(PROMPTS))
    finally:
        await asyncio.to_thread(launcher.stop)
