"""How fast a full server says no: RESOURCE_EXHAUSTED latency under a burst.

    python -m benchmarks overload [--burst 200] [--rounds 3]

The stack starts as `tokenmill up` runs it (the Launcher: four processes, one OpenMP thread
each) with a scheduler that runs one request and queues four (--max-num-seqs 1
--max-waiting-requests 4). Each round fills it (one long greedy stream running, four waiting),
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

import asyncio
import subprocess
import sys
from dataclasses import dataclass

from benchmarks.harness import flags
from benchmarks.harness.bursts import FLOOR_SERVER, BurstResult, burst, describe, one_by_one
from benchmarks.harness.client import generation_stub, greedy_request
from benchmarks.harness.flags import setting
from benchmarks.harness.launch import LaunchSpec, executor_flags, launched, scheduler_flags
from benchmarks.harness.paths import STORIES as _STORIES
from benchmarks.harness.stats import percentile
from services.executor.config import ExecutorConfig
from services.scheduler.core.config import SchedulerLimits

PROG = "python -m benchmarks overload"
STORIES = str(_STORIES)
QUEUED = 4


@dataclass(frozen=True, slots=True)
class OverloadSettings:
    burst: int = setting(200)
    """Calls in one burst."""
    rounds: int = setting(3)
    """Bursts (each against a freshly filled queue)."""
    floor: bool = setting(True)
    """First time the bursts against a bare server that only refuses."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "burst", "rounds")


async def fill(stub, metadata=None) -> list:
    """One long stream running and QUEUED waiting: the queue is full when this returns."""
    calls = [stub.Generate(greedy_request("Once upon a time", 480), timeout=120, metadata=metadata)]
    async for message in calls[0]:
        if message.WhichOneof("event") == "delta":
            break
    for i in range(QUEUED):
        call = stub.Generate(greedy_request(f"The cat number {i}", 480), timeout=120, metadata=metadata)
        await call.read()  # Started: it holds a place
        calls.append(call)
    return calls


async def run_floor(address: str, n: int, rounds: int) -> BurstResult:
    async with generation_stub(address) as stub:
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
    async with generation_stub(address) as stub:
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
            bursts.add(b)
            serials.add(s)
            await asyncio.sleep(0.5)
        print(describe("burst all", bursts))
        print(describe("serial all", serials))
        return bursts


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    settings = flags.parse(OverloadSettings, argv, prog=prog, description=__doc__)
    base = floor(settings.burst, settings.rounds) if settings.floor else None
    executor = ExecutorConfig(model=STORIES, num_blocks=256, block_size=16, dtype="fp32", device="cpu")
    limits = SchedulerLimits(max_num_seqs=1, max_waiting_requests=QUEUED)
    launch = LaunchSpec(STORIES, tuple(executor_flags(executor, only_changed=True)),
                        tuple(scheduler_flags(limits, only_changed=True)), threads=1, quiet=False, restart=True,
                        metrics=False, log_prefix="tokenmill-burst-")
    with launched(launch) as stack:
        ours = asyncio.run(run(stack.address, settings.burst, settings.rounds))
    if base is not None and base.refused_ms and ours.refused_ms:
        print(f"burst / floor: p50 {percentile(ours.refused_ms, 50) / percentile(base.refused_ms, 50):.2f}x, "
              f"p99 {percentile(ours.refused_ms, 99) / percentile(base.refused_ms, 99):.2f}x")
    return 0
