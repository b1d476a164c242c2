"""The gateway over two real stories260K stacks (processes, as `tokenmill up` starts them).

- One stack is slowed (its executor stopped and continued on a duty cycle, as a noisy
  neighbour would slow it, the cycle's stopped part grown until the stack is measured four
  times slower than the other, however loaded the machine already is): the latency route
  keeps requests with an SLA on the fast one and sends SLA-free ones to the cheap slow one
  while it is within the route's cheapest_within of the fast one's estimate, to the fast one
  beyond (the default 2x).
- One stack's scheduler is SIGKILLed under load: every request that had not started streaming
  still succeeds (it moves to the other target), and the killed target, restarted by its
  launcher, is probed back into the pool.
- A scheduler dies while admitting a request with a structured output: the request is not
  retried on the other target (a hostile grammar could kill every replica in turn) and an
  identical one is refused at once. A target that is simply down (its port refuses connections)
  quarantines nothing: the structured output is served by the other target, and again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import statistics
import threading
import time

import grpc
import openai
import pytest
import pytest_asyncio

from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import create_channel
from tests.helpers.gateway_stack import serve_gateway_for, wait_healthy, write_routes
from tests.helpers.launched_stack import launched_stack
from tests.helpers.service_harness import STORIES_DIR

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

EXECUTOR = dict(dtype="fp32", device="cpu", attention_backend="torch", num_blocks=256)
PROMPT = "Once upon a time"
STOPPED_S = (0.03, 0.06, 0.12, 0.24, 0.48)
"""The stopped part of each cycle, tried in turn until the stack is slow enough."""
RUNNING_S = 0.01
ONE_STEP = ["--num-scheduler-steps=1"]
"""The slowed stack asks its executor for each token: every token meets the cycle alike. (Bursts of
steps would meet a stop once per burst: a few long gaps among quick tokens, a slow stream whose
median time per token, all the latency route goes by, stays quick.)"""
SLOWER = 4.0
"""How many times slower than the fast stack the cheap one is made: beyond the "bounded" route's
2x with margin either way (an SLA of twice the fast time), far within the "stories" route's 20x."""


class DutyCycle:
    """SIGSTOP / SIGCONT a process on a cycle, from a thread, until closed; ``stopped_s`` may be
    changed while it runs."""

    def __init__(self, pid: int, stopped_s: float) -> None:
        self.pid = pid
        self.stopped_s = stopped_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGSTOP)
            time.sleep(self.stopped_s)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            time.sleep(RUNNING_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with launched_stack(STORIES_DIR, logs / "a", executor=EXECUTOR) as fast, \
            launched_stack(STORIES_DIR, logs / "b", executor=EXECUTOR, scheduler_args=ONE_STEP) as cheap:
        yield fast, cheap


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gateway(stacks, tmp_path_factory):
    fast, cheap = stacks
    routes = write_routes(tmp_path_factory.mktemp("routes") / "routes.json", {
        "targets": [{"name": "fast", "address": fast.public_address, "cost": 1.0},
                    {"name": "cheap", "address": cheap.public_address, "cost": 0.2}],
        # SLA-free requests take the cheap target while within 20x the best estimate ("stories")
        # or within the default 2x ("bounded").
        "models": {"stories": {"route": {"strategy": "latency", "targets": ["fast", "cheap"], "cheapest_within": 20}},
                   "bounded": {"route": {"strategy": "latency", "targets": ["fast", "cheap"]}},
                   "spread": {"strategy": "loadbalance", "targets": ["fast", "cheap"]},
                   "cheap-first": {"strategy": "fallback", "targets": ["cheap", "fast"]}}})
    running = await serve_gateway_for(routes)
    await wait_healthy(running, ["fast", "cheap"])
    yield running
    await running.stop(grace=0)


def served(gateway, model: str) -> dict[str, float]:
    """requests_total{outcome="ok"} per target of one model, from the gateway's metrics."""
    text = gateway.dispatcher.metrics.exposition().decode()
    pattern = rf'tokenmill:gateway_requests_total{{model="{model}",outcome="ok",target="(\w+)"}} ([0-9.]+)'
    return {target: float(count) for target, count in re.findall(pattern, text)}


async def direct_e2e_ms(address: str, n: int, max_tokens: int) -> float:
    async with create_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        times = []
        for i in range(n):
            request = generation_pb2.GenerateRequest(text=f"{PROMPT} {i}")
            request.sampling.temperature = 0.0
            request.stop.max_tokens = max_tokens
            request.stop.ignore_eos = True
            began = time.monotonic()
            async for _ in stub.Generate(request, timeout=60):
                pass
            times.append((time.monotonic() - began) * 1000.0)
    return statistics.median(times)


async def gateway_sees(gateway, sla_ms: float, timeout_s: float = 20.0) -> None:
    """Wait until the gateway's own estimates put the fast stack within ``sla_ms`` and the slowed
    one past it, as the stacks were just measured: a poll of each profile has to land first, and
    on a loaded machine one can take longer than any fixed pause."""
    states = gateway.dispatcher.pool.states
    deadline = time.monotonic() + timeout_s
    while True:
        now = time.monotonic()
        fast, cheap = (states[name].estimate_ms(32, False, now) for name in ("fast", "cheap"))
        if fast is not None and cheap is not None and fast < sla_ms < cheap:
            return
        if now > deadline:
            raise AssertionError(f"after {timeout_s} s the gateway estimates fast {fast} ms and cheap {cheap} ms "
                                 f"against an SLA of {sla_ms:.0f} ms")
        await asyncio.sleep(0.05)


async def slow_down(fast, cheap, gateway) -> tuple[DutyCycle, float, float]:
    """Duty-cycle the cheap stack's executor until the cheap stack takes over SLOWER times as long
    as the fast one: (the cycle, fast ms, slow ms), measured here and now. A cycle does not slow a
    stack by a fixed factor: each stop adds a wait to the steps that meet it, while the fast
    stack's time grows with the machine's load (each step waits for a core), so a cycle that is
    four times slower on an idle machine is under twice as slow on a loaded one."""
    fast_ms = await direct_e2e_ms(fast.public_address, 6, 32)
    cycle = DutyCycle(cheap.services["executor"].process.pid, STOPPED_S[0])
    for stopped_s in STOPPED_S:
        cycle.stopped_s = stopped_s
        slow_ms = await direct_e2e_ms(cheap.public_address, 6, 32)
        if slow_ms > SLOWER * fast_ms:
            break
    else:
        cycle.close()
        raise AssertionError(f"a {STOPPED_S[-1]} s stop of every cycle did not make the stack {SLOWER}x slower: "
                             f"{slow_ms:.0f} vs {fast_ms:.0f} ms")
    if stopped_s != STOPPED_S[0]:
        # The gateway's profile of the cheap stack (its last window_s) still holds the faster
        # requests of the weaker cycles: wait them out, then measure both stacks again (the
        # fast one's window is empty by then: a target with no data would be ranked last).
        await asyncio.sleep(gateway.dispatcher.pool.window_s)
        fast_ms = await direct_e2e_ms(fast.public_address, 6, 32)
        slow_ms = await direct_e2e_ms(cheap.public_address, 6, 32)
    if not slow_ms > 2.5 * fast_ms:
        cycle.close()
        raise AssertionError(f"the slowed stack is not 2.5x slower: {slow_ms:.0f} vs {fast_ms:.0f} ms")
    return cycle, fast_ms, slow_ms


async def test_latency_route_keeps_sla_requests_on_the_fast_stack_and_the_rest_on_the_cheap_one(stacks, gateway):
    fast, cheap = stacks
    slow, fast_ms, slow_ms = await slow_down(fast, cheap, gateway)
    try:
        print(f"fast {fast_ms:.0f} ms, slowed {slow_ms:.0f} ms with {slow.stopped_s} s stops")
        sla = (fast_ms * slow_ms) ** 0.5
        await gateway_sees(gateway, sla)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="-", max_retries=0)
        before = served(gateway, "stories")
        for i in range(16):
            await client.completions.create(model="stories", prompt=f"{PROMPT} {i}", max_tokens=32,
                                            extra_body={"ignore_eos": True},
                                            extra_headers={"x-tokenmill-sla-ms": f"{sla:.0f}"})
        with_sla = {k: v - before.get(k, 0) for k, v in served(gateway, "stories").items()}
        for i in range(8):
            await client.completions.create(model="stories", prompt=f"{PROMPT} {i}", max_tokens=32,
                                            extra_body={"ignore_eos": True})
        after = served(gateway, "stories")
        without_sla = {k: after[k] - before.get(k, 0) - with_sla.get(k, 0) for k in after}
        before = served(gateway, "bounded")
        for i in range(8):
            await client.completions.create(model="bounded", prompt=f"{PROMPT} {i}", max_tokens=32,
                                            extra_body={"ignore_eos": True})
        bounded = {k: v - before.get(k, 0) for k, v in served(gateway, "bounded").items()}
    finally:
        slow.close()
    assert with_sla.get("fast", 0) >= 14, (with_sla, fast_ms, slow_ms, sla)
    assert without_sla.get("cheap", 0) == 8, without_sla
    # Four times slower than the fast one: beyond the default bound, so SLA-free traffic goes fast.
    assert bounded.get("fast", 0) >= 7, (bounded, fast_ms, slow_ms)


async def test_a_target_killed_under_load_fails_no_request_that_had_not_streamed(stacks, gateway):
    fast, cheap = stacks
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="-", max_retries=0)
    outcomes: list[tuple[bool, str]] = []  # (had streamed a token, error or "")

    async def one(i: int) -> None:
        streamed = False
        try:
            stream = await client.completions.create(model="spread", prompt=f"{PROMPT} {i}", max_tokens=48,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                streamed = streamed or bool(chunk.choices and chunk.choices[0].text)
                if chunk.choices and chunk.choices[0].finish_reason is None and "error" in (chunk.model_extra or {}):
                    raise RuntimeError("in-band error")
            outcomes.append((streamed, ""))
        except Exception as exc:  # noqa: BLE001 - recorded and judged below
            outcomes.append((streamed, f"{type(exc).__name__}: {exc}"))

    fallbacks_before = gateway.dispatcher.metrics.fallbacks.labels("spread", "cheap", "UNAVAILABLE")._value.get()
    load = [asyncio.create_task(one(i)) for i in range(16)]
    await asyncio.sleep(0.15)
    cheap.services["scheduler"].process.send_signal(signal.SIGKILL)
    burst = [asyncio.create_task(one(100 + i)) for i in range(16)]  # sent before any poll notices
    await asyncio.gather(*load, *burst)
    failed = [(streamed, error) for streamed, error in outcomes if error]
    assert all(streamed for streamed, _ in failed), failed
    assert len(outcomes) == 32 and len(failed) < 16
    fallbacks = gateway.dispatcher.metrics.fallbacks.labels("spread", "cheap", "UNAVAILABLE")._value.get()
    assert fallbacks > fallbacks_before or failed, "the kill reached no request: the test proved nothing"
    # The launcher restarts the scheduler on its port; the pool probes it back in.
    await back_in_the_pool(gateway, "cheap")


async def back_in_the_pool(gateway, name: str) -> None:
    """Wait until target ``name`` serves again, then send it one request: its breaker, opened by
    the failures of a kill and half-open once its open_s has passed, takes that request as its
    probe and closes. (A target is "healthy" while half-open: the next request sent to it, whatever
    it is, would be the probe, and a probe's failure says nothing of the request.)"""
    target = gateway.dispatcher.pool.targets[name]
    deadline = time.monotonic() + 90
    while not target.state.healthy and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert target.state.healthy
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="-",
                                  max_retries=0) as client:
        raw = await client.completions.with_raw_response.create(model=f"{name}-first", prompt=PROMPT, max_tokens=4)
    assert raw.headers["x-tokenmill-target"] == name and raw.parse().choices[0].finish_reason == "length"
    assert target.breaker.state == "closed", target.breaker.state


async def test_a_target_that_dies_admitting_a_structured_output_is_not_retried_and_the_grammar_is_quarantined(
        stacks, gateway):
    fast, cheap = stacks
    await wait_healthy(gateway, ["fast", "cheap"], timeout_s=90)
    await back_in_the_pool(gateway, "cheap")  # not half-open: the request below is not a breaker's probe
    request = generation_pb2.GenerateRequest(text=PROMPT)
    request.stop.max_tokens = 4
    request.structured_output.regex = "(ab|cd)+"
    metadata = (("x-tokenmill-model", "cheap-first"),)
    scheduler = cheap.services["scheduler"].process
    async with create_channel(gateway.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # The cheap target's scheduler stops with the request at its door, then dies: it failed
        # before Started, as a scheduler killed by the grammar it compiles does.
        scheduler.send_signal(signal.SIGSTOP)
        call = stub.Generate(request, metadata=metadata, timeout=30)
        replies = asyncio.ensure_future(_drain(call))
        target = gateway.dispatcher.pool.targets["cheap"]
        while not target.state.inflight and not replies.done():  # sent (a loaded gateway may take a while)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        scheduler.send_signal(signal.SIGKILL)
        code, details = await replies
        assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
        assert "failed while admitting this request's structured_output; it is not retried" in details
        began = time.monotonic()
        code, details = await _drain(stub.Generate(request, metadata=metadata, timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "structured_output is quarantined" in details
        assert time.monotonic() - began < 1.0
        # Another structured output is served, by the other target while the killed one restarts.
        other = generation_pb2.GenerateRequest()
        other.CopyFrom(request)
        other.structured_output.regex = "(ef|gh)+"
        code, details = await _drain(stub.Generate(other, metadata=metadata, timeout=60))
        assert code == grpc.StatusCode.OK, details


class Relay:
    """A TCP relay in front of an address, closed for good at will: a target whose port then
    refuses connections, as a machine that went down does."""

    def __init__(self, to: str) -> None:
        self.host, port = to.rsplit(":", 1)
        self.port = int(port)
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Relay:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        self.writers += [writer, up_writer]

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        await self.server.wait_closed()

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def test_a_target_that_is_down_quarantines_no_structured_output(stacks, tmp_path):
    fast, cheap = stacks
    request = generation_pb2.GenerateRequest(text=PROMPT)
    request.stop.max_tokens = 4
    request.structured_output.regex = "(ij|kl)+"
    async with Relay(fast.public_address) as relay:  # two targets, one engine: the relay's goes down
        routes = write_routes(tmp_path / "routes.json", {
            "targets": [{"name": "gone", "address": relay.address}, {"name": "fast", "address": fast.public_address}],
            "models": {"gone-first": {"strategy": "fallback", "targets": ["gone", "fast"]}}})
        # Polled once at start, then not for a minute: the pool does not see the target go.
        running = await serve_gateway_for(routes, profile_interval_s=60.0)
        try:
            await wait_healthy(running, ["gone", "fast"], timeout_s=90)
            await relay.close()
            async with create_channel(running.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                for _ in range(2):
                    code, details = await _drain(stub.Generate(request, metadata=(("x-tokenmill-model", "gone-first"),),
                                                               timeout=60))
                    assert code == grpc.StatusCode.OK, details
            fallbacks = running.dispatcher.metrics.fallbacks.labels("gone-first", "gone", "UNAVAILABLE")._value.get()
            assert fallbacks == 1, "the request never met the down target: the test proved nothing"
        finally:
            await running.stop(grace=0)


async def _drain(call) -> tuple[grpc.StatusCode, str]:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""
