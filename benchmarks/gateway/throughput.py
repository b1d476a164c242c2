"""Routed requests per second of one gateway process on one core, against simulated targets.

The gateway runs pinned to one CPU (taskset), the simulator (8 engines answering one token at
once) and this load generator on the other. Closed loop: ``concurrency`` clients each send a
request as soon as their previous one finished, for ``seconds``, over the gateway's gRPC API
(unary-shaped streams of one token) and over HTTP (non-streamed /v1/completions). Reported:
requests/s, the gateway's CPU time in that window (from /proc), and requests per CPU-second of
the gateway: what one core sustains when nothing else limits it. For scale, the simulator's CPU
per request too: it serves the same streamed call the gateway serves, and the gateway also makes
one (to the simulator), so a gateway near twice the simulator's cost is spending its time in
gRPC, not in routing.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx2

from benchmarks.gateway.processes import gateway, simulator
from benchmarks.harness.cpu import process_cpu_seconds
from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import create_channel

ENGINES = [{"name": "sim", "prefill_ms": 0.0, "tpot_ms": 0.2, "batch_slowdown": 0.0, "max_running": 4096,
            "count": 8}]


def cpu_seconds(pid: int) -> float:
    seconds = process_cpu_seconds(pid)
    if seconds is None:
        raise ProcessLookupError(f"process {pid} is gone")
    return seconds


async def _grpc_load(address: str, concurrency: int, seconds: float) -> int:
    done = 0
    async with create_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(text="hello there")
        request.stop.max_tokens = 1
        stop_at = time.monotonic() + seconds

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                async for _ in stub.Generate(request, timeout=30):
                    pass
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


async def _http_load(base: str, concurrency: int, seconds: float) -> int:
    done = 0
    body = {"model": "sim", "prompt": "hello there", "max_tokens": 1}
    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx2.AsyncClient(base_url=base, limits=limits, timeout=30) as client:
        stop_at = time.monotonic() + seconds

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                response = await client.post("/v1/completions", json=body)
                response.raise_for_status()
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def measure(seconds: float = 8.0, concurrency: int = 32, gateway_cpu: str = "1", others_cpu: str = "0") -> dict:
    os.sched_setaffinity(0, {int(c) for c in others_cpu.split(",")})
    out = {}
    with simulator(ENGINES, cpus=others_cpu) as (addresses, sim_pid):
        names = sorted(addresses)
        routes = {"targets": [{"name": n, "address": a} for n, a in sorted(addresses.items())],
                  "models": {"sim": {"strategy": "latency", "targets": names}}}
        with gateway(routes, cpus=gateway_cpu) as (grpc_address, http_base, pid):
            for front, load in (("grpc", lambda: _grpc_load(grpc_address, concurrency, seconds)),
                                ("http", lambda: _http_load(http_base, concurrency, seconds))):
                asyncio.run(_warm(front, grpc_address, http_base))
                cpu0, sim0, t0 = cpu_seconds(pid), cpu_seconds(sim_pid), time.monotonic()
                count = asyncio.run(load())
                wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
                sim_cpu = cpu_seconds(sim_pid) - sim0
                out[front] = {"requests": count, "requests_per_s": count / wall, "gateway_cpu_s": cpu,
                              "gateway_cpu_share": cpu / wall, "requests_per_gateway_cpu_s": count / max(cpu, 1e-9),
                              "gateway_cpu_us_per_request": cpu / max(count, 1) * 1e6,
                              "simulator_cpu_us_per_request": sim_cpu / max(count, 1) * 1e6}
    return out


async def _warm(front: str, grpc_address: str, http_base: str) -> None:
    if front == "grpc":
        await _grpc_load(grpc_address, 4, 0.5)
    else:
        await _http_load(http_base, 4, 0.5)
