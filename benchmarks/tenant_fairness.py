"""Two tenants, one flooding: does the quiet tenant's time to first token hold?

    python -m benchmarks.tenant_fairness [--seconds 20] [--flood 40]

The stack runs as `tokenmill up` runs it (the Launcher, four processes) with authentication
(tenants "quiet" and "flood") and a small batch (--max-num-seqs=8), so the flood must queue.
The quiet tenant sends one greedy request at a time (16 tokens), back to back, and times each
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

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from benchmarks.overload_burst import percentile
from benchmarks.serving.cpu_time import process_cpu_seconds
from services.common.pb.tokenmill.v1 import generation_pb2_grpc
from services.common.server import create_channel
from services.common.service_config import REPO_ROOT
from services.stack.client import build_request
from services.stack.launcher import LaunchConfig, Launcher

STORIES = str(REPO_ROOT / "models" / "stories260K")
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
        async for message in stub.Generate(build_request(PROMPTS[i % len(PROMPTS)], max_tokens=16, temperature=0.0,
                                                         ignore_eos=True), timeout=60, metadata=bearer("tq")):
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
            async for _ in stub.Generate(build_request(PROMPTS[seed % len(PROMPTS)], max_tokens=64, temperature=0.0,
                                                       ignore_eos=True), timeout=120, metadata=bearer("tf")):
                pass
            done += 1
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.05)
    return done


async def flood_only(address: str, flood: int) -> None:
    """The flood client process: runs until it is terminated."""
    async with create_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await asyncio.gather(*(flood_stream(stub, asyncio.Event(), i) for i in range(flood)))


def cpu_shares(pids: dict[str, int]) -> Callable[[float], str]:
    """Start counting the processes' CPU; the function returned says each one's CPU since, over
    the wall seconds it is given, as a fraction of one core."""
    before = {name: process_cpu_seconds(pid) for name, pid in pids.items()}

    def share(name: str, pid: int, seconds: float) -> str:
        after, start = process_cpu_seconds(pid), before[name]
        return f"{name} {(after - start) / seconds:.2f}" if after is not None and start is not None else f"{name} ?"

    return lambda seconds: ", ".join(share(name, pid, seconds) for name, pid in pids.items())


async def run(address: str, seconds: float, flood: int, flood_client: str, service_pids: dict[str, int]) -> None:
    async with create_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await quiet_ttfts(stub, 1.0)  # warm up
        alone = await quiet_ttfts(stub, seconds)
        stop = asyncio.Event()
        if flood_client == "same":
            flooders = [asyncio.create_task(flood_stream(stub, stop, i)) for i in range(flood)]
        else:
            process = subprocess.Popen([sys.executable, "-m", "benchmarks.tenant_fairness", "--flood-at", address,
                                        "--flood", str(flood)], cwd=str(REPO_ROOT))
        await asyncio.sleep(2.0)  # the flood's queue builds up
        pids = dict(service_pids, quiet_client=os.getpid())
        if flood_client != "same":
            pids["flood_client"] = process.pid
        started = time.monotonic()
        read_shares = cpu_shares(pids)
        loaded = await quiet_ttfts(stub, seconds)
        shares = read_shares(time.monotonic() - started)
        stop.set()
        if flood_client == "same":
            flooded = sum(await asyncio.gather(*flooders))
        else:
            process.terminate()
            process.wait()
            flooded = "(counted in its process)"
    print(f"quiet tenant, one request at a time; flood tenant {flood} streams (max-num-seqs 8), "
          f"flood client: {flood_client}")
    for name, quiet in (("alone", alone), ("flooded", loaded)):
        print(f"{name:<8} requests {len(quiet.ttft):>4}  TTFT p50 {percentile(quiet.ttft, 0.5):7.2f} ms  "
              f"p99 {percentile(quiet.ttft, 0.99):7.2f} ms")
        for part, values in (("queue", quiet.queue), ("server TTFT", quiet.server_ttft),
                             ("outside the core", quiet.outside), ("  of it, to Started", quiet.to_started)):
            print(f"    {part:<17} p50 {percentile(values, 0.5):7.2f} ms  p99 {percentile(values, 0.99):7.2f} ms")
    print(f"flood requests completed: {flooded}")
    print(f"CPU while flooded, cores: {shares}")
    print(f"TTFT p99 flooded / alone: {percentile(loaded.ttft, 0.99) / percentile(alone.ttft, 0.99):.2f}x "
          f"(p50 {percentile(loaded.ttft, 0.5) / percentile(alone.ttft, 0.5):.2f}x)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--flood", type=int, default=40)
    parser.add_argument("--flood-client", choices=("process", "same"), default="process",
                        help="the flood's client in a process of its own, or in the quiet client's event loop")
    parser.add_argument("--scheduler-arg", action="append", default=[], metavar="FLAG",
                        help="an extra scheduler flag, e.g. --scheduler-arg=--num-scheduler-steps=1 (repeatable)")
    parser.add_argument("--flood-at", help=argparse.SUPPRESS)  # the flood client process
    args = parser.parse_args(argv)
    if args.flood_at:
        try:
            asyncio.run(flood_only(args.flood_at, args.flood))
        except KeyboardInterrupt:
            pass
        return
    run_dir = Path(tempfile.mkdtemp(prefix="tokenmill-fairness-"))
    tokens = run_dir / "tokens.json"
    tokens.write_text(json.dumps([{"token": "tq", "tenant": "quiet"}, {"token": "tf", "tenant": "flood"}]))
    launcher = Launcher(LaunchConfig(
        model=STORIES, public_port=0, log_dir=str(run_dir / "logs"),
        executor_args=["--num-blocks=512", "--block-size=16", "--dtype=fp32", "--device=cpu"],
        scheduler_args=["--max-num-seqs=8", f"--auth-tokens-file={tokens}", *args.scheduler_arg],
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "TOKENMILL_LOG_LEVEL": "warning"}))
    launcher.start()
    try:
        service_pids = {name: svc.process.pid for name, svc in launcher.services.items() if svc.process is not None}
        asyncio.run(run(launcher.public_address, args.seconds, args.flood, args.flood_client, service_pids))
    finally:
        launcher.stop()


if __name__ == "__main__":
    main()
