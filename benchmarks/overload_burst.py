"""How fast a full server says no: RESOURCE_EXHAUSTED latency under a burst.

    python -m benchmarks.overload_burst [--burst 200] [--rounds 3]

The stack starts as `tokenmill up` runs it (the Launcher: four processes, one OpenMP thread
each) with a scheduler that runs one request and queues four (--max-num-seqs=1
--max-waiting-requests=4). Each round fills it (one long greedy stream running, four waiting),
then sends ``--burst`` Generate calls at once from one client, each with a text prompt, and
times each call from the moment it is issued to its status. Only RESOURCE_EXHAUSTED answers
count (a call that found a place freed meanwhile is reported apart). Then the same number of
calls one after another, which times the refusal without the burst's queueing in the client
and the server's event loop. Prints p50/p99/max per round and over all rounds, and whether every
refusal carried grpc-retry-pushback-ms.

``--floor`` (on by default) first times the same bursts against a bare grpc.aio server in its
own process whose Generate does nothing but answer RESOURCE_EXHAUSTED: what gRPC in Python
costs on this machine, client and server together, below which no refusal can go. The
scheduler's figures are then also given as a ratio to it, which is steadier than the
milliseconds on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import grpc

from services.common.pb.tokenmill.v1 import generation_pb2_grpc
from services.common.server import create_channel
from services.common.service_config import REPO_ROOT
from services.stack.client import build_request
from services.stack.launcher import LaunchConfig, Launcher

STORIES = str(REPO_ROOT / "models" / "stories260K")
QUEUED = 4
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


@dataclass
class BurstResult:
    refused_ms: list[float] = field(default_factory=list)
    """Issue-to-status time of each RESOURCE_EXHAUSTED answer."""
    admitted: int = 0
    other: list[str] = field(default_factory=list)
    without_pushback: int = 0
    bursts: list[tuple[float, float]] = field(default_factory=list)
    """(time.monotonic() the burst was sent, its slowest refusal in ms), where a caller records them."""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


async def timed_call(stub, prompt: str, result: BurstResult, metadata=None) -> None:
    started = time.perf_counter()
    call = stub.Generate(build_request(prompt, max_tokens=2, temperature=0.0, ignore_eos=True), timeout=30,
                         metadata=metadata)
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


async def fill(stub, metadata=None) -> list:
    """One long stream running and QUEUED waiting: the queue is full when this returns."""
    calls = [stub.Generate(build_request("Once upon a time", max_tokens=480, temperature=0.0, ignore_eos=True),
                           timeout=120, metadata=metadata)]
    async for message in calls[0]:
        if message.WhichOneof("event") == "delta":
            break
    for i in range(QUEUED):
        call = stub.Generate(build_request(f"The cat number {i}", max_tokens=480, temperature=0.0, ignore_eos=True),
                             timeout=120, metadata=metadata)
        await call.read()  # Started: it holds a place
        calls.append(call)
    return calls


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
    return (f"{name:<12} refused {len(ms):>4}  p50 {percentile(ms, 0.5):7.2f} ms  p99 {percentile(ms, 0.99):7.2f} ms"
            f"  max {max(ms) if ms else float('nan'):7.2f} ms  admitted {result.admitted}  other {result.other or '-'}"
            f"  without pushback {result.without_pushback}")


async def run_floor(address: str, n: int, rounds: int) -> BurstResult:
    async with create_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await one_by_one(stub, 3)
        bursts = BurstResult()
        for r in range(rounds):
            b = await burst(stub, n)
            print(describe(f"floor {r + 1}", b))
            bursts.refused_ms += b.refused_ms
            await asyncio.sleep(0.5)
        print(describe("floor all", bursts))
        return bursts


def floor(n: int, rounds: int) -> BurstResult:
    process = subprocess.Popen([sys.executable, "-c", FLOOR_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(process.stdout.readline())
        return asyncio.run(run_floor(f"127.0.0.1:{port}", n, rounds))
    finally:
        process.kill()
        process.wait()


async def run(address: str, n: int, rounds: int) -> BurstResult:
    async with create_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await one_by_one(stub, 3)  # warm the channel and the server's handlers
        bursts, serials = BurstResult(), BurstResult()
        for r in range(rounds):
            calls = await fill(stub)
            b = await burst(stub, n)
            s = await one_by_one(stub, n)
            for call in calls:
                call.cancel()
            print(describe(f"burst {r + 1}", b))
            print(describe(f"serial {r + 1}", s))
            for total, part in ((bursts, b), (serials, s)):
                total.refused_ms += part.refused_ms
                total.admitted += part.admitted
                total.other += part.other
                total.without_pushback += part.without_pushback
            await asyncio.sleep(0.5)
        print(describe("burst all", bursts))
        print(describe("serial all", serials))
        return bursts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                        help="first time the bursts against a bare server that only refuses")
    args = parser.parse_args(argv)
    base = floor(args.burst, args.rounds) if args.floor else None
    launcher = Launcher(LaunchConfig(
        model=STORIES, public_port=0, log_dir=tempfile.mkdtemp(prefix="tokenmill-burst-"),
        executor_args=["--num-blocks=256", "--block-size=16", "--dtype=fp32", "--device=cpu"],
        scheduler_args=["--max-num-seqs=1", f"--max-waiting-requests={QUEUED}"],
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}))
    launcher.start()
    try:
        ours = asyncio.run(run(launcher.public_address, args.burst, args.rounds))
    finally:
        launcher.stop()
    if base is not None and base.refused_ms and ours.refused_ms:
        print(f"burst / floor: p50 {percentile(ours.refused_ms, 0.5) / percentile(base.refused_ms, 0.5):.2f}x, "
              f"p99 {percentile(ours.refused_ms, 0.99) / percentile(base.refused_ms, 0.99):.2f}x")


if __name__ == "__main__":
    main()
