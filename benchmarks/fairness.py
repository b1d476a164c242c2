"""Two tenants, one flooding: does the quiet tenant's time to first token hold?

    python -m benchmarks fairness [--seconds 20] [--flood 40]

The stack runs as `tokenmill up` runs it (the Launcher, four processes) with authentication
(tenants "quiet" and "flood") and a small batch (--max-num-seqs 8), so the flood must queue;
every scheduler limit is a flag of this run too (``--num-scheduler-steps 1``,
``--no-overlap-scheduling``). The quiet tenant sends one greedy request at a time (16 tokens), back to back, and times each
request's first token. First alone (its unloaded TTFT), then while the flood tenant keeps
``--flood`` streams of 64 tokens open (ten times the quiet tenant's one, and five times the
batch), again with the queue ordered by the virtual token counter. Prints p50/p99 TTFT both
ways and the ratio loaded/unloaded (the target is p99 within 1.5x).

The flood runs in a client process of its own (``--flood-client process``, the default), as two
tenants' clients would: sharing the quiet client's event loop, its 40 streams' messages delay
the quiet client's reading of its own first token, which is the benchmark measuring itself
(``--flood-client same`` keeps that setup, for comparison).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from benchmarks.harness import child as harness_child, flags
from benchmarks.harness.client import generation_stub, greedy_request
from benchmarks.harness.cpu import core_shares
from benchmarks.harness.flags import setting
from benchmarks.harness.launch import LaunchSpec, executor_flags, launched, scheduler_flags
from benchmarks.harness.paths import STORIES as _STORIES
from benchmarks.harness.stats import percentile
from services.common.settings import embedded
from services.executor.config import ExecutorConfig
from services.scheduler.core.config import SchedulerLimits

PROG = "python -m benchmarks fairness"
STORIES = str(_STORIES)
PROMPTS = ["Once upon a time", "The cat", "Lily wanted", "Tom and his dog", "The sun was hot", "Mom said"]


def bearer(token: str):
    return (("authorization", f"Bearer {token}"),)


@dataclass
class QuietRun:
    """The quiet tenant's requests, in ms: TTFT as its client saw it, and the scheduler's own
    account from each request's Finished timings (queue: admitted to first scheduled; server
    TTFT: admitted to first token). Client TTFT less server TTFT is what lies outside the core:
    the call reaching the servicer, the prompt's Encode and delivering the token; of it, the
    call's start to its Started message (sent once admitted) is the part before the core."""

    ttft: list[float] = field(default_factory=list)
    to_started: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    server_ttft: list[float] = field(default_factory=list)

    @property
    def outside(self) -> list[float]:
        return [client - server for client, server in zip(self.ttft, self.server_ttft)]


async def quiet_ttfts(stub, seconds: float) -> QuietRun:
    run, stop_at, i = QuietRun(), time.monotonic() + seconds, 0
    while time.monotonic() < stop_at:
        started = time.perf_counter()
        first = None
        async for message in stub.Generate(greedy_request(PROMPTS[i % len(PROMPTS)], 16), timeout=60,
                                           metadata=bearer("tq")):
            if message.WhichOneof("event") == "started":
                run.to_started.append((time.perf_counter() - started) * 1000)
            if first is None and message.WhichOneof("event") == "delta":
                first = time.perf_counter() - started
            if message.WhichOneof("event") == "finished":
                timings = message.finished.timings
                run.queue.append(timings.queue_time_ms)
                run.server_ttft.append(timings.time_to_first_token_ms)
        run.ttft.append(first * 1000)
        i += 1
    return run


async def flood_stream(stub, stop: asyncio.Event, seed: int) -> int:
    done = 0
    while not stop.is_set():
        try:
            async for _ in stub.Generate(greedy_request(PROMPTS[seed % len(PROMPTS)], 64), timeout=120,
                                         metadata=bearer("tf")):
                pass
            done += 1
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.05)
    return done


def flood_client(address: str, flood: int) -> None:
    """The flood client process (harness.child): runs until it is terminated."""
    async def run() -> None:
        async with generation_stub(address) as stub:
            await asyncio.gather(*(flood_stream(stub, asyncio.Event(), i) for i in range(flood)))

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


async def run(address: str, seconds: float, flood: int, flood_client: str, service_pids: dict[str, int],
              max_num_seqs: int) -> None:
    async with generation_stub(address) as stub:
        await quiet_ttfts(stub, 1.0)  # warm up
        alone = await quiet_ttfts(stub, seconds)
        stop = asyncio.Event()
        if flood_client == "same":
            flooders = [asyncio.create_task(flood_stream(stub, stop, i)) for i in range(flood)]
        else:
            process = subprocess.Popen(harness_child.command("benchmarks.fairness:flood_client", address=address,
                                                             flood=flood), cwd=harness_child.CWD)
        await asyncio.sleep(2.0)  # the flood's queue builds up
        pids = dict(service_pids, quiet_client=os.getpid())
        if flood_client != "same":
            pids["flood_client"] = process.pid
        started = time.monotonic()
        read_shares = core_shares(pids)
        loaded = await quiet_ttfts(stub, seconds)
        shares = read_shares(time.monotonic() - started)
        stop.set()
        if flood_client == "same":
            flooded = sum(await asyncio.gather(*flooders))
        else:
            process.terminate()
            process.wait()
            flooded = "(counted in its process)"
    print(f"quiet tenant, one request at a time; flood tenant {flood} streams (max-num-seqs {max_num_seqs}), "
          f"flood client: {flood_client}")
    for name, quiet in (("alone", alone), ("flooded", loaded)):
        print(f"{name:<8} requests {len(quiet.ttft):>4}  TTFT p50 {percentile(quiet.ttft, 50):7.2f} ms  "
              f"p99 {percentile(quiet.ttft, 99):7.2f} ms")
        for part, values in (("queue", quiet.queue), ("server TTFT", quiet.server_ttft),
                             ("outside the core", quiet.outside), ("  of it, to Started", quiet.to_started)):
            print(f"    {part:<17} p50 {percentile(values, 50):7.2f} ms  p99 {percentile(values, 99):7.2f} ms")
    print(f"flood requests completed: {flooded}")
    print(f"CPU while flooded, cores: {shares}")
    print(f"TTFT p99 flooded / alone: {percentile(loaded.ttft, 99) / percentile(alone.ttft, 99):.2f}x "
          f"(p50 {percentile(loaded.ttft, 50) / percentile(alone.ttft, 50):.2f}x)")


@dataclass(frozen=True, slots=True)
class FairnessSettings:
    seconds: float = setting(20.0)
    """Seconds of the quiet tenant's requests, alone and then flooded."""
    flood: int = setting(40)
    """Streams the flood tenant keeps open."""
    flood_client: str = setting("process")
    """The flood's client in a process of its own (process), or in the quiet client's event loop (same)."""
    limits: SchedulerLimits = embedded(SchedulerLimits, env_prefix="TOKENMILL_",
                                       default=SchedulerLimits(max_num_seqs=8))

    def validate(self) -> None:
        flags.check_at_least(self, 1, "flood")
        flags.check_choices("flood_client", self.flood_client, ("process", "same"))
        self.limits.validate()


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    settings = flags.parse(FairnessSettings, argv, prog=prog, description=__doc__)
    run_dir = Path(tempfile.mkdtemp(prefix="tokenmill-fairness-"))
    tokens = run_dir / "tokens.json"
    tokens.write_text(json.dumps([{"token": "tq", "tenant": "quiet"}, {"token": "tf", "tenant": "flood"}]))
    tokens.chmod(0o600)  # the scheduler refuses a tokens file others may read
    executor = ExecutorConfig(model=STORIES, num_blocks=512, block_size=16, dtype="fp32", device="cpu")
    launch = LaunchSpec(STORIES, tuple(executor_flags(executor, only_changed=True)),
                        (*scheduler_flags(settings.limits, only_changed=True), f"--auth-tokens-file={tokens}"),
                        threads=1, restart=True, metrics=False, log_prefix="tokenmill-fairness-")
    with launched(launch) as stack:
        asyncio.run(run(stack.address, settings.seconds, settings.flood, settings.flood_client, stack.pids,
                        settings.limits.max_num_seqs))
    return 0
