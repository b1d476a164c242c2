"""Bursts of Generate calls against a full server, each refusal timed from issue to status.

A burst is ``n`` calls at once from one client; ``one_by_one`` sends the same calls one after
another, which times a refusal without the burst's queueing in the client and the server's
event loop. Only RESOURCE_EXHAUSTED answers are timed (a call that found a place freed
meanwhile is counted as admitted), and each must carry grpc-retry-pushback-ms.
FLOOR_SERVER is a bare grpc.aio server whose Generate only refuses: what gRPC in Python costs
on this machine, client and server together, below which no refusal can go.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from benchmarks.harness.client import greedy_request
from benchmarks.harness.stats import percentile

FLOOR_SERVER = """
import asyncio, sys, grpc, grpc.aio
async def refuse(request, context):
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full",
                        trailing_metadata=(("grpc-retry-pushback-ms", "100"),))
async def main():
    handler = grpc.method_handlers_generic_handler(
        "tokenmill.v1.Generation", {"Generate": grpc.unary_stream_rpc_method_handler(refuse)})
    server = grpc.aio.server(handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
import uvloop
uvloop.run(main())
"""
"""Run with ``python -c``; prints the port it listens on, then serves until killed."""


@dataclass
class BurstResult:
    refused_ms: list[float] = field(default_factory=list)
    """Issue-to-status time of each RESOURCE_EXHAUSTED answer."""
    admitted: int = 0
    other: list[str] = field(default_factory=list)
    without_pushback: int = 0
    bursts: list[tuple[float, float]] = field(default_factory=list)
    """(time.monotonic() the burst was sent, its slowest refusal in ms), where a caller records them."""

    def add(self, part: BurstResult) -> None:
        """Fold ``part``'s calls into this total."""
        self.refused_ms += part.refused_ms
        self.admitted += part.admitted
        self.other += part.other
        self.without_pushback += part.without_pushback
        self.bursts += [tuple(b) for b in part.bursts]


async def timed_call(stub, prompt: str, result: BurstResult, metadata=None) -> None:
    started = time.perf_counter()
    call = stub.Generate(greedy_request(prompt, 2), timeout=30, metadata=metadata)
    try:
        async for _ in call:
            pass
        result.admitted += 1
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            result.refused_ms.append((time.perf_counter() - started) * 1000)
            if "grpc-retry-pushback-ms" not in dict(err.trailing_metadata() or ()):
                result.without_pushback += 1
        else:
            result.other.append(err.code().name)


async def burst(stub, n: int, metadata=None) -> BurstResult:
    result = BurstResult()
    await asyncio.gather(*(timed_call(stub, f"Burst request {i}", result, metadata) for i in range(n)))
    return result


async def one_by_one(stub, n: int, metadata=None) -> BurstResult:
    result = BurstResult()
    for i in range(n):
        await timed_call(stub, f"Serial request {i}", result, metadata)
    return result


def describe(name: str, result: BurstResult) -> str:
    ms = result.refused_ms
    return (f"{name:<12} refused {len(ms):>4}  p50 {percentile(ms, 50):7.2f} ms  p99 {percentile(ms, 99):7.2f} ms"
            f"  max {max(ms) if ms else float('nan'):7.2f} ms  admitted {result.admitted}  other {result.other or '-'}"
            f"  without pushback {result.without_pushback}")
