"""What the gateway's HTTP API costs over calling the engine's gRPC API directly.

One stories260K stack (the four services as `tokenmill up` starts them), or with ``engine="sim"``
one simulated engine (benchmarks/gateway/simulator: 2 ms prefill and per token, no model, so
the engine's own CPU and variance are out of the figure), and one gateway process in front of
it. Alternating rounds (A/B/C, then C/B/A), the same requests three ways: the engine's gRPC API
directly, the gateway's gRPC API (the hop alone) and the gateway's HTTP API (the hop and the
OpenAI front end):

- TTFT: sequential streamed requests (8 tokens); time from sending to the first token's bytes
  (gRPC: the first Delta; HTTP: the first SSE chunk with text), p50 and p99 of each way;
- throughput: ``streams`` concurrent streams of ``tokens`` tokens (EOS ignored), total tokens
  over the wall time of the round (direct gRPC and HTTP only).

Clients: grpc.aio for gRPC, httpx2 (the HTTP client the openai package is built on) reading SSE
lines for HTTP, in this process. On a machine shared with other work the wall-clock ratios move
with the other load, so CPU time is read from /proc too: the engine's four processes per token
(gRPC rounds) and the gateway's per token (HTTP rounds); where the engine is bound by the CPU the
gateway shares, its tokens/s scale by engine / (engine + gateway) (``cpu_bound_ratio``).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time

import httpx2

from benchmarks.gateway.processes import gateway, simulator
from benchmarks.gateway.throughput import cpu_seconds
from benchmarks.harness.launch import LaunchSpec, launched
from benchmarks.harness.paths import STORIES
from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import create_channel

PROMPT = "Once upon a time"
MODES = ("grpc", "gateway_grpc", "http")
SIM_ENGINE = {"name": "engine", "prefill_ms": 2.0, "tpot_ms": 2.0, "max_running": 64}
"""The simulated engine of ``engine="sim"``: a step as short as a small model's on this machine."""


def _request(tokens: int, i: int) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(text=f"{PROMPT} {i}")
    request.sampling.temperature = 0.0
    request.stop.max_tokens = tokens
    request.stop.ignore_eos = True
    return request


async def _grpc_one(stub, tokens: int, i: int) -> float:
    began, first = time.perf_counter(), None
    async for reply in stub.Generate(_request(tokens, i), timeout=120):
        if first is None and reply.WhichOneof("event") == "delta":
            first = time.perf_counter()
    return ((first or time.perf_counter()) - began) * 1000.0


async def _http_one(client: httpx2.AsyncClient, tokens: int, i: int) -> float:
    body = {"model": "stories", "prompt": f"{PROMPT} {i}", "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    began, first = time.perf_counter(), None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter()
    return ((first or time.perf_counter()) - began) * 1000.0


async def _round(mode: str, stubs: dict, client, ttft_requests: int, streams: int,
                 tokens: int) -> tuple[list[float], float | None]:
    one = (lambda t, i: _http_one(client, t, i)) if mode == "http" else (lambda t, i: _grpc_one(stubs[mode], t, i))
    ttfts = [await one(8, i) for i in range(ttft_requests)]
    if mode == "gateway_grpc":
        return ttfts, None
    began = time.perf_counter()
    await asyncio.gather(*(one(tokens, 1000 + i) for i in range(streams)))
    return ttfts, streams * tokens / (time.perf_counter() - began)


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def _measure(engine: str, gateway_grpc: str, http_base: str, pid: int, engine_pids: list[int], rounds: int,
                   ttft_requests: int, streams: int, tokens: int) -> dict:
    results = {mode: {"ttft": [], "tps": []} for mode in MODES}
    gateway_cpu = engine_cpu = 0.0
    http_tokens = grpc_tokens = 0
    limits = httpx2.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with create_channel(engine) as channel, create_channel(gateway_grpc) as gateway_channel, \
            httpx2.AsyncClient(base_url=http_base, limits=limits, timeout=120) as client:
        stubs = {"grpc": generation_pb2_grpc.GenerationStub(channel),
                 "gateway_grpc": generation_pb2_grpc.GenerationStub(gateway_channel)}
        for mode in MODES:  # warm every path
            await _round(mode, stubs, client, 3, 4, 16)
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                cpu0, engine0 = cpu_seconds(pid), sum(cpu_seconds(p) for p in engine_pids)
                ttfts, tps = await _round(mode, stubs, client, ttft_requests, streams, tokens)
                if mode == "http":
                    gateway_cpu += cpu_seconds(pid) - cpu0
                    http_tokens += ttft_requests * 8 + streams * tokens
                elif mode == "grpc":
                    engine_cpu += sum(cpu_seconds(p) for p in engine_pids) - engine0
                    grpc_tokens += ttft_requests * 8 + streams * tokens
                results[mode]["ttft"].extend(ttfts)
                if tps is not None:
                    results[mode]["tps"].append(tps)
    return _summary(results, gateway_cpu / max(http_tokens, 1) * 1e6, engine_cpu / max(grpc_tokens, 1) * 1e6)


def _summary(results: dict, gateway_us: float, engine_us: float) -> dict:
    out = {}
    for mode, data in results.items():
        out[mode] = {"ttft_p50_ms": statistics.median(data["ttft"]), "ttft_p99_ms": _p99(data["ttft"])}
        if data["tps"]:
            out[mode].update(tokens_per_s=statistics.median(data["tps"]), tokens_per_s_rounds=data["tps"])
    direct = out["grpc"]
    for mode in ("http", "gateway_grpc"):
        prefix = "ttft" if mode == "http" else "hop"
        out[f"{prefix}_p50_added_ms"] = out[mode]["ttft_p50_ms"] - direct["ttft_p50_ms"]
        out[f"{prefix}_p99_added_ms"] = out[mode]["ttft_p99_ms"] - direct["ttft_p99_ms"]
    out["tokens_per_s_ratio"] = out["http"]["tokens_per_s"] / direct["tokens_per_s"]
    out["gateway_cpu_us_per_token"] = gateway_us
    out["engine_cpu_us_per_token"] = engine_us
    # Where the engine is bound by CPU the gateway shares, its tokens/s scale by this much:
    out["cpu_bound_ratio"] = engine_us / (engine_us + gateway_us) if engine_us else None
    return out


def measure(rounds: int = 3, ttft_requests: int = 20, streams: int = 32, tokens: int = 128,
            start_timeout_s: float = 600.0, engine: str = "stories") -> dict:
    """``start_timeout_s``: how long each service and the gateway may take to start (a service that
    exits while starting fails the run at once; on a loaded machine a healthy start can take minutes).
    ``engine``: "stories" (the stack) or "sim" (one simulated engine)."""
    load_before = os.getloadavg()
    if engine == "sim":
        with simulator([SIM_ENGINE]) as (addresses, sim_pid):
            out = _through_gateway(addresses["engine"], [sim_pid], rounds, ttft_requests, streams, tokens,
                                   start_timeout_s)
    else:
        out = _on_stack(rounds, ttft_requests, streams, tokens, start_timeout_s)
    return {**out, "engine": engine, "load_before": load_before, "load_after": os.getloadavg()}


def _through_gateway(address: str, engine_pids: list[int], rounds: int, ttft_requests: int, streams: int,
                     tokens: int, start_timeout_s: float) -> dict:
    routes = {"targets": [{"name": "engine", "address": address}], "models": {"stories": "engine"}}
    with gateway(routes, start_timeout_s=start_timeout_s) as (grpc_address, http_base, pid):
        return asyncio.run(_measure(address, grpc_address, http_base, pid, engine_pids, rounds, ttft_requests,
                                    streams, tokens))


def _on_stack(rounds: int, ttft_requests: int, streams: int, tokens: int, start_timeout_s: float) -> dict:
    with launched(LaunchSpec(str(STORIES), threads=1, quiet=False, metrics=False, log_prefix="tokenmill-bench-gw-",
                             start_timeout_s=start_timeout_s)) as stack:
        return _through_gateway(stack.address, list(stack.pids.values()), rounds, ttft_requests, streams, tokens,
                                start_timeout_s)
