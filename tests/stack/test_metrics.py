"""Metrics endpoints and GetProfile on a real stack (tokenizer, executor, scheduler in this process).

All three servers share this process's default registry, so every endpoint shows every
metric; the assertions read the counters each service owns through its own port.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from services.cli import profile as profile_cli
from services.stack.client import build_request
from services.common.metrics import parse_samples
from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import create_channel
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.executor.main import serve as serve_executor
from services.scheduler.config import ProfileSettings, SchedulerServiceConfig
from services.scheduler.main import serve as serve_scheduler
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import serve as serve_tokenizer
from tests.helpers.service_harness import STORIES_DIR
from tests.helpers.engine_runs import generate_all

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 12
PROMPTS = ([5, 6, 7, 8, 9], [30, 31, 32], [100, 101, 102, 103, 104, 105, 106])
GENERATE = 'method="Generate",service="tokenmill.v1.Generation"'


async def scrape(port: int, query: str = "") -> dict[str, float]:
    def get() -> tuple[int, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics{query}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    status, text = await asyncio.to_thread(get)
    assert status == 200
    return parse_samples(text)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack() -> AsyncIterator[dict]:
    model = str(STORIES_DIR)
    tokenizer = await serve_tokenizer(TokenizerConfig(port=0, model=model, metrics_port=0))
    executor = await serve_executor(ExecutorServiceConfig(port=0, metrics_port=0, executor=ExecutorConfig(
        model=model, dtype="fp32", device="cpu", attention_backend="torch", block_size=8, num_blocks=128)))
    scheduler = await serve_scheduler(SchedulerServiceConfig(
        port=0, executor_addresses=(executor.address,), tokenizer_addresses=(tokenizer.address,), metrics_port=0,
        profile=ProfileSettings(profile_window_s=60.0)))
    yield {"tokenizer": tokenizer, "executor": executor, "scheduler": scheduler}
    for running in (scheduler, executor, tokenizer):
        await running.stop(grace=0)


async def generate_all(address: str) -> list[list[list[int]]]:
    """Each prompt's stream as its deltas' token ids."""
    async with create_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(prompt: list[int]) -> list[list[int]]:
            request = build_request(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            deltas: list[list[int]] = []
            async for message in stub.Generate(request, timeout=60):
                if message.WhichOneof("event") == "delta":
                    deltas.append(list(message.delta.token_ids))
            return deltas

        return await asyncio.gather(*(one(list(p)) for p in PROMPTS))


async def test_endpoints_answer_and_counters_move(stack):
    scheduler, executor, tokenizer = stack["scheduler"], stack["executor"], stack["tokenizer"]
    ports = {name: running.metrics_port for name, running in stack.items()}
    assert len(set(ports.values())) == 3 and all(p > 0 for p in ports.values())
    before = await scrape(ports["scheduler"])
    # The execute histogram is process-wide: an executor an earlier test ran in this process counted into it.
    executed_before = (await scrape(ports["executor"])).get("tokenmill:executor_execute_seconds_count", 0.0)
    streams = await generate_all(scheduler.address)
    assert [sum(map(len, deltas)) for deltas in streams] == [MAX_TOKENS] * len(PROMPTS)

    after = await scrape(ports["scheduler"])

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("tokenmill:generation_tokens_total") == MAX_TOKENS * len(PROMPTS)
    assert moved("tokenmill:prompt_tokens_total") == sum(len(p) for p in PROMPTS)
    assert moved("tokenmill:time_to_first_token_seconds_count") == len(PROMPTS)
    assert moved("tokenmill:time_per_output_token_seconds_count") == len(PROMPTS)
    assert moved("tokenmill:e2e_request_latency_seconds_count") == len(PROMPTS)
    assert moved("tokenmill:request_queue_time_seconds_count") == len(PROMPTS)
    # One gap per pair of consecutive deltas the scheduler published (a multi-step burst's
    # tokens come in one delta). The client may have received fewer messages: deltas that
    # queued behind a write still in flight travel together.
    gaps = moved("tokenmill:inter_token_latency_seconds_count")
    assert sum(len(deltas) - 1 for deltas in streams) <= gaps <= (MAX_TOKENS - 1) * len(PROMPTS)
    assert moved(f"tokenmill:rpc_latency_seconds_count{{{GENERATE}}}") == len(PROMPTS)
    # The prompts share no block, so every prompt token was looked up and none hit.
    assert moved("tokenmill:prefix_cache_queries_total") == sum(len(p) for p in PROMPTS)
    assert moved("tokenmill:prefix_cache_hits_total") == 0
    steps = moved("tokenmill:scheduler_steps_total")
    # Every delta came out of a step of its own (bursts put several tokens in one step's delta).
    assert max(len(deltas) for deltas in streams) <= steps <= MAX_TOKENS * len(PROMPTS)
    assert moved('tokenmill:scheduler_step_phase_seconds_total{phase="executor"}') > 0
    assert after["tokenmill:num_requests_running"] == 0
    assert after["tokenmill:num_requests_waiting"] == 0
    assert after["tokenmill:kv_cache_usage_perc"] == 0.0
    assert after["tokenmill:kv_cache_waste_perc"] == 0.0
    assert after["tokenmill:num_preemptions_total"] == 0
    # A filtered scrape (what the benchmark samples during a run) returns just the named gauges.
    filtered = await scrape(
        ports["scheduler"], "?name[]=tokenmill:kv_cache_waste_perc&name[]=tokenmill:num_requests_running")
    assert filtered == {"tokenmill:kv_cache_waste_perc": 0.0, "tokenmill:num_requests_running": 0.0}

    # The executor's own endpoint: one timed execute per step the scheduler sent. The plan that
    # tells the executor to forget the last finished sequences may go out after the streams
    # ended, so both sides are read again until they settle (they must then agree).
    deadline = asyncio.get_running_loop().time() + 5.0
    while True:
        executor_samples = await scrape(ports["executor"])
        scheduler_steps = (await scrape(ports["scheduler"]))["tokenmill:scheduler_steps_total"]
        executed = executor_samples["tokenmill:executor_execute_seconds_count"] - executed_before
        if executed == scheduler_steps or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert executed == scheduler_steps
    # Every service's RPCs are timed; a stream is observed when it ends, so the scheduler's
    # long-lived Step and Detokenize streams have a labelled series with no observation yet.
    tokenizer_samples = await scrape(ports["tokenizer"])

    def rpc_count(service: str, method: str) -> float:
        return tokenizer_samples[f'tokenmill:rpc_latency_seconds_count{{method="{method}",service="{service}"}}']

    assert rpc_count("tokenmill.v1.Tokenizer", "GetTokenizerInfo") >= 1
    assert rpc_count("tokenmill.v1.Executor", "GetExecutorInfo") >= 1
    assert rpc_count("tokenmill.v1.Tokenizer", "Detokenize") == 0
    assert rpc_count("tokenmill.v1.Executor", "Step") == 0


async def test_get_profile_reflects_requests_just_served(stack):
    address = stack["scheduler"].address
    async with create_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        first = await stub.GetProfile(generation_pb2.GetProfileRequest(window_seconds=300.0), timeout=10)
        await generate_all(address)
        profile = await stub.GetProfile(generation_pb2.GetProfileRequest(window_seconds=300.0), timeout=10)
    assert profile.window_seconds == 300.0
    assert profile.num_requests == first.num_requests + len(PROMPTS)
    assert profile.max_output_tokens == MAX_TOKENS
    assert 0 < profile.ttft_p50_ms <= profile.ttft_p99_ms
    assert 0 < profile.tpot_p50_ms <= profile.tpot_p99_ms
    assert profile.tokens_per_second_total > 0 and profile.tokens_per_second_per_stream > 0
    assert (profile.num_running, profile.num_waiting, profile.kv_cache_usage) == (0, 0, 0.0)

    # The CLI prints the same numbers (it is a blocking client: keep it off the event loop).
    def run_cli() -> str:
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert profile_cli.main(["--address", address, "--window", "300", "--json"]) == 0
        return out.getvalue()

    printed = json.loads(await asyncio.to_thread(run_cli))
    assert printed["num_requests"] == profile.num_requests
    assert printed["max_output_tokens"] == MAX_TOKENS
    assert printed["window_seconds"] == 300.0


@pytest.mark.slow
async def test_executor_metrics_count_tokens_per_expert(tmp_path):
    """A mixture-of-experts model served by the real services: its executor's /metrics counts the
    tokens routed to each expert of each sparse layer, the served tokens only (not the warm-up's).
    Last in this file: its servers count into the process-wide RPC metrics the test above reads."""
    from services.tools.random_model import build_random_model
    from tests.helpers.moe_specs import MOE_SPECS

    spec = MOE_SPECS["mixtral"]
    model = str(build_random_model(spec, tmp_path / "mixtral"))
    tokenizer = await serve_tokenizer(TokenizerConfig(port=0, model=model, metrics_port=0))
    executor = await serve_executor(ExecutorServiceConfig(port=0, metrics_port=0, executor=ExecutorConfig(
        model=model, dtype="fp32", device="cpu", attention_backend="torch", block_size=8, num_blocks=64)))
    scheduler = await serve_scheduler(SchedulerServiceConfig(
        port=0, executor_addresses=(executor.address,), tokenizer_addresses=(tokenizer.address,)))
    try:
        before = await scrape(executor.metrics_port)
        assert sum(v for k, v in before.items() if k.startswith("tokenmill:executor_moe_expert_tokens_total")) == 0
        streams = await generate_all(scheduler.address)
        assert [sum(map(len, deltas)) for deltas in streams] == [MAX_TOKENS] * len(PROMPTS)
        after = await scrape(executor.metrics_port)
        # every prompt token and every generated token but the last of each stream went through each layer
        tokens = sum(len(p) for p in PROMPTS) + (MAX_TOKENS - 1) * len(PROMPTS)
        for layer in range(spec.num_layers):
            routed = [after[f'tokenmill:executor_moe_expert_tokens_total{{expert="{e}",layer="{layer}"}}']
                      for e in range(spec.num_experts)]
            assert sum(routed) == tokens * spec.num_experts_per_tok
    finally:
        for running in (scheduler, executor, tokenizer):
            await running.stop(grace=0)
