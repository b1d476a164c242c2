"""The engine simulator: exact step timings on a virtual clock, and the real Generation API it
serves, behind the real gateway (a latency route over three simulated speeds)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import openai
import pytest

from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import create_channel
from benchmarks.gateway.simulator.config import SimulatorConfig
from benchmarks.gateway.simulator.engine import SimEngine, SimSpec
from benchmarks.gateway.simulator.main import serve_engine
from tests.helpers.gateway_stack import serve_gateway_for, stop_all, wait_healthy, write_routes


class VirtualTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


async def drain(req) -> list:
    events = []
    while True:
        kind, value = await req.queue.get()
        events.append((kind, value))
        if kind == "finished":
            return events


async def test_one_request_takes_prefill_then_a_step_per_token():
    vt = VirtualTime()
    engine = SimEngine(SimSpec("e", prefill_ms=20, tpot_ms=5, max_running=4), clock=vt.clock, sleep=vt.sleep)
    events = await drain(engine.submit("a", 10, 3))
    finished = events[-1][1]
    assert sum(n for kind, n in events if kind == "tokens") == 10 == finished.completion_tokens
    assert finished.ttft_ms == pytest.approx(25.0)  # its prefill and first token share the first step
    assert finished.e2e_ms == pytest.approx(25.0 + 9 * 5.0)
    assert finished.reason == "length"


async def test_batching_slows_every_step_and_a_full_batch_queues():
    vt = VirtualTime()
    engine = SimEngine(SimSpec("e", prefill_ms=0, tpot_ms=10, batch_slowdown=0.5, max_running=2),
                       clock=vt.clock, sleep=vt.sleep)
    reqs = [engine.submit(f"r{i}", 4, 1) for i in range(3)]
    a, b, c = [(await drain(r))[-1][1] for r in reqs]
    # two run together: each step 10 * (1 + 0.5) = 15 ms, four steps
    assert a.e2e_ms == pytest.approx(60.0) and b.e2e_ms == pytest.approx(60.0)
    # the third waited for them, then ran alone at 10 ms a step
    assert c.queue_ms == pytest.approx(60.0) and c.ttft_ms == pytest.approx(70.0) and c.e2e_ms == pytest.approx(100.0)


async def test_stream_interval_batches_deltas_and_abort_ends_the_request():
    vt = VirtualTime()
    engine = SimEngine(SimSpec("e", prefill_ms=0, tpot_ms=1, stream_interval=4), clock=vt.clock, sleep=vt.sleep)
    events = await drain(engine.submit("a", 10, 1))
    assert [n for kind, n in events if kind == "tokens"] == [1, 4, 4, 1]
    req = engine.submit("b", 1000, 1)
    await asyncio.sleep(0)
    assert engine.abort("b") and not engine.abort("nope")
    assert (await drain(req))[-1][1].reason == "abort"
    assert not engine.live


def test_the_engine_list_is_checked():
    assert [s.name for s in SimulatorConfig(engines='[{"name": "w", "count": 3}]').specs()] == ["w-0", "w-1", "w-2"]
    for engines, message in [("[]", "non-empty"), ('[{"name": "a", "speed": 1}]', "unknown fields"),
                             ('[{"name": "a"}, {"name": "a"}]', "unique"), ('[{"name": "a", "tpot_ms": 0}]', "tpot_ms")]:
        with pytest.raises(ValueError, match=message):
            SimulatorConfig(engines=engines).specs()


@pytest.mark.slow
async def test_the_gateway_routes_over_simulated_engines_on_their_live_latency(tmp_path: Path):
    specs = [SimSpec("fast", prefill_ms=2, tpot_ms=1, max_running=64), SimSpec("slow", prefill_ms=40, tpot_ms=15),
             SimSpec("cheap", prefill_ms=40, tpot_ms=15)]
    sims = [await serve_engine(s) for s in specs]
    routes = write_routes(tmp_path / "routes.json", {
        "targets": [{"name": s.name, "address": srv.address, "cost": {"fast": 1.0, "slow": 0.5, "cheap": 0.1}[s.name]}
                    for s, srv in zip(specs, sims)],
        "models": {"m": {"strategy": "latency", "targets": ["fast", "slow", "cheap"], "cheapest_within": 50}}})
    gateway = await serve_gateway_for(routes)
    await wait_healthy(gateway, ["fast", "slow", "cheap"])
    try:
        async with create_channel(gateway.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def generate(sla_ms: float | None) -> list:
                request = generation_pb2.GenerateRequest(text="hello")
                request.stop.max_tokens = 20
                md = (("x-tokenmill-sla-ms", str(sla_ms)),) if sla_ms else ()
                return [m async for m in stub.Generate(request, metadata=md, timeout=30)]

            # No data yet: the least loaded first; every target gets a few requests.
            await asyncio.gather(*(generate(None) for _ in range(6)))
            await asyncio.sleep(0.3)  # a poll reads the profiles
            before = _served(gateway)
            replies = [await generate(150.0) for _ in range(10)]
            with_sla = _delta(_served(gateway), before)
            before = _served(gateway)
            for _ in range(5):
                await generate(None)
            without_sla = _delta(_served(gateway), before)
            assert replies[0][0].WhichOneof("event") == "started"
            assert replies[0][-1].finished.usage.completion_tokens == 20
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(-1)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await stop_all([gateway, *sims])
    assert with_sla == {"fast": 10}, with_sla
    assert without_sla == {"cheap": 5}, without_sla


def _served(gateway) -> dict[str, float]:
    text = gateway.dispatcher.metrics.exposition().decode()
    return {t: float(n) for t, n in re.findall(r'gateway_requests_total\{model="m",outcome="ok",target="(\w+)"} ([0-9.]+)',
                                               text)}


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


async def test_the_http_api_answers_the_openai_client_as_the_engine_generates():
    server = await serve_engine(SimSpec("fast-0", prefill_ms=5, tpot_ms=2, stream_interval=4), http=True)
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0)
        prompt = [{"role": "user", "content": "x" * 40}]
        answer = await client.chat.completions.create(model="any", messages=prompt, max_tokens=10)
        assert answer.model == "fast-0" and answer.choices[0].finish_reason == "length"
        assert answer.choices[0].message.content == " t" * 10
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (10, 10)
        stream = await client.chat.completions.create(model="any", messages=prompt, max_tokens=10, stream=True)
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == " t" * 10
        assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 10
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="any", messages=prompt, max_tokens=0)
        assert not server.sim_engine.live and not server.sim_engine.running
    finally:
        await server.stop(grace=0)
