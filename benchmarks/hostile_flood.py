"""One tenant floods the stack with hostile requests: do the other tenant's streams all complete,
and how far does its time to first token move?

    python -m benchmarks.hostile_flood [--seconds 20] [--attackers 4] [--victim-streams 2]

The stack runs as ``tokenmill up`` runs it (the Launcher, processes) with authentication
(tenants "victim" and "attacker"), serving stories260K with its config vocab padded to 1,024
rows past its tokenizer's 512 ids (services/tools/padded_vocab.py), as Qwen2-family checkpoints
ship theirs. The victim keeps ``--victim-streams`` greedy requests of 32 tokens in flight, back
to back, and times each one's first token: first alone, then while the attacker's client
process sends, from ``--attackers`` loops as fast as the answers come, in turn:

- ids past the tokenizer: token_ids naming id 550, logit_bias {550: 100}, stop_token_ids [550],
  and plain greedy requests, which on this model sample the padded rows unless they are masked;
- oversized chats: 2.5 million empty messages (12.5 MB), and 1,100 messages within the size limit;
- calls without a valid token: 16 MiB bodies and undecodable ones, with no token or a wrong one.

Prints the victim's TTFT p50/p99 alone and flooded with their ratio, how many of its streams
completed (and how the others ended), and the attacker's outcomes by kind and status.
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from benchmarks.overload_burst import percentile
from benchmarks.serving.cpu_time import process_cpu_seconds
from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.common.server import create_channel
from services.common.service_config import REPO_ROOT
from services.stack.client import build_request
from services.stack.launcher import LaunchConfig, Launcher
from services.tools.padded_vocab import pad_vocab

STORIES = REPO_ROOT / "models" / "stories260K"
PADDED_VOCAB = 1024
PADDED_ID = 550
"""An id the model's config has (padding) and its tokenizer does not."""
PROMPTS = ["Once upon a time", "The cat", "Lily wanted", "Tom and his dog", "The sun was hot", "Mom said"]
VICTIM, ATTACKER = "tv", "ta"
GENERATE = "/tokenmill.v1.Generation/Generate"


def bearer(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def attack_bodies() -> list[tuple[str, str | None, bytes]]:
    """(kind, bearer token, serialized GenerateRequest), built as bytes: millions of messages
    would take the client seconds to build through protobuf."""
    bodies: list[tuple[str, str | None, bytes]] = []

    def typed(kind: str, request: generation_pb2.GenerateRequest, token: str | None = ATTACKER) -> None:
        bodies.append((kind, token, request.SerializeToString()))

    r = build_request([1, PADDED_ID], max_tokens=4, temperature=0.0)
    typed("id past the tokenizer", r)
    r = build_request("Once", max_tokens=4, temperature=0.0)
    r.sampling.logit_bias[PADDED_ID] = 100.0
    typed("logit_bias past the tokenizer", r)
    r = build_request("Once", max_tokens=4, temperature=0.0)
    r.stop.stop_token_ids.append(PADDED_ID)
    typed("stop id past the tokenizer", r)
    typed("greedy (padded rows outscore)", build_request("The dog", max_tokens=8, temperature=0.0, ignore_eos=True))
    empty_message = _field(1, _field(1, b"u"))  # ChatMessages.messages[i] = {role: "u"}
    bodies.append(("2.5M empty chat messages", ATTACKER, _field(4, empty_message * 2_500_000)))
    turn = _field(1, _field(1, b"user") + _field(2, b"hi"))
    bodies.append(("1,100 chat messages", ATTACKER, _field(4, turn * 1100)))
    bodies.append(("16 MiB without a token", None, _field(2, b"a" * (16 << 20))))
    bodies.append(("undecodable, wrong token", "not-a-token", b"\xff" * 4096))
    return bodies


@dataclass
class VictimRun:
    ttft_ms: list[float] = field(default_factory=list)
    ends: Counter = field(default_factory=Counter)
    """How each stream ended: its finish reason, or the status of a failed call."""

    @property
    def completed(self) -> int:
        return self.ends["length"]


async def victim_loop(stub, run: VictimRun, stop: asyncio.Event, offset: int) -> None:
    i = offset
    while not stop.is_set():
        request = build_request(PROMPTS[i % len(PROMPTS)], max_tokens=32, temperature=0.0, ignore_eos=True)
        i += 1
        started = time.perf_counter()
        first = None
        end = "no Finished"
        try:
            async for message in stub.Generate(request, metadata=bearer(VICTIM), timeout=120):
                kind = message.WhichOneof("event")
                if kind == "delta" and message.delta.token_ids and first is None:
                    first = time.perf_counter()
                elif kind == "finished":
                    end = common_pb2.FinishReason.Name(message.finished.finish_reason).removeprefix(
                        "FINISH_REASON_").lower()
        except grpc.aio.AioRpcError as err:
            end = err.code().name
        run.ends[end] += 1
        if first is not None and end == "length":
            run.ttft_ms.append((first - started) * 1000)


async def victim(stub, seconds: float, streams: int) -> VictimRun:
    run, stop = VictimRun(), asyncio.Event()
    loops = [asyncio.create_task(victim_loop(stub, run, stop, i)) for i in range(streams)]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*loops)
    return run


async def attack(address: str, attackers: int, report: Path) -> None:
    """The attacker's client process: sends until SIGTERM, writing its counts to ``report`` often."""
    bodies = attack_bodies()
    counts: dict[str, Counter] = {kind: Counter() for kind, _, _ in bodies}
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        raw = channel.unary_stream(GENERATE, response_deserializer=generation_pb2.GenerateResponse.FromString)

        async def loop(start: int) -> None:
            for n in range(start, 1 << 62):
                kind, token, body = bodies[n % len(bodies)]
                outcome = "OK"
                try:
                    async for message in raw(body, metadata=bearer(token), timeout=60):
                        if message.WhichOneof("event") == "finished":
                            outcome = "OK " + common_pb2.FinishReason.Name(message.finished.finish_reason)
                except grpc.aio.AioRpcError as err:
                    outcome = err.code().name
                counts[kind][outcome] += 1

        async def write_report() -> None:
            while True:
                await asyncio.sleep(0.5)
                report.write_text(json.dumps({kind: dict(c) for kind, c in counts.items()}))

        await asyncio.gather(write_report(), *(loop(i) for i in range(attackers)))


def cpu_seconds(pids: dict[str, int]) -> dict[str, float | None]:
    return {name: process_cpu_seconds(pid) for name, pid in pids.items()}


async def run(address: str, seconds: float, attackers: int, streams: int, pids: dict[str, int],
              run_dir: Path) -> dict:
    async with create_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await victim(stub, 1.0, streams)  # warm up
        alone = await victim(stub, seconds, streams)
        report = run_dir / "attack.json"
        process = subprocess.Popen([sys.executable, "-m", "benchmarks.hostile_flood", "--attack-at", address,
                                    "--attackers", str(attackers), "--report", str(report)], cwd=str(REPO_ROOT))
        try:
            await asyncio.sleep(3.0)  # the attacker's client builds its bodies and gets going
            before = cpu_seconds({**pids, "attacker": process.pid})
            started = time.monotonic()
            flooded = await victim(stub, seconds, streams)
            wall = time.monotonic() - started
            after = cpu_seconds({**pids, "attacker": process.pid})
        finally:
            process.terminate()
            process.wait()
    attacks = json.loads(report.read_text()) if report.is_file() else {}
    cores = {name: round((after[name] - before[name]) / wall, 2)
             for name in after if after[name] is not None and before[name] is not None}
    return {"alone": alone, "flooded": flooded, "attacks": attacks, "cores": cores}


def show(result: dict, streams: int, attackers: int) -> None:
    alone, flooded = result["alone"], result["flooded"]
    print(f"victim: {streams} greedy streams of 32 tokens back to back; attacker: {attackers} loops")
    for name, victim_run in (("alone", alone), ("flooded", flooded)):
        total = sum(victim_run.ends.values())
        print(f"{name:<8} streams {total:>4}  completed {victim_run.completed:>4}  "
              f"TTFT p50 {percentile(victim_run.ttft_ms, 0.5):7.2f} ms  p99 {percentile(victim_run.ttft_ms, 0.99):7.2f} ms"
              + ("" if victim_run.completed == total else f"  other ends: {dict(victim_run.ends - Counter(length=victim_run.completed))}"))
    print("attacker's calls while flooded, by kind:")
    for kind, counts in result["attacks"].items():
        print(f"    {kind:<32} " + ", ".join(f"{code} {n}" for code, n in sorted(counts.items())))
    print(f"CPU while flooded, cores: {result['cores']}")
    print(f"victim TTFT p99 flooded / alone: {percentile(flooded.ttft_ms, 0.99) / percentile(alone.ttft_ms, 0.99):.2f}x "
          f"(p50 {percentile(flooded.ttft_ms, 0.5) / percentile(alone.ttft_ms, 0.5):.2f}x)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="each phase (alone, flooded)")
    parser.add_argument("--attackers", type=int, default=4, help="the attacker's concurrent loops")
    parser.add_argument("--victim-streams", type=int, default=2)
    parser.add_argument("--executor-arg", action="append", default=[], metavar="FLAG",
                        help="an extra executor flag, e.g. --executor-arg=--attention-backend=torch (repeatable)")
    parser.add_argument("--attack-at", help=argparse.SUPPRESS)  # the attacker's client process
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.attack_at:
        try:
            asyncio.run(attack(args.attack_at, args.attackers, Path(args.report)))
        except KeyboardInterrupt:
            pass
        return
    run_dir = Path(tempfile.mkdtemp(prefix="tokenmill-hostile-"))
    model = pad_vocab(STORIES, run_dir / "stories-padded", PADDED_VOCAB)
    tokens = run_dir / "tokens.json"
    tokens.write_text(json.dumps([{"token": VICTIM, "tenant": "victim"}, {"token": ATTACKER, "tenant": "attacker"}]))
    tokens.chmod(0o600)
    launcher = Launcher(LaunchConfig(
        model=str(model), public_port=0, log_dir=str(run_dir / "logs"),
        executor_args=["--num-blocks=512", "--block-size=16", "--dtype=fp32", "--device=cpu", *args.executor_arg],
        scheduler_args=["--max-num-seqs=8", f"--auth-tokens-file={tokens}"],
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "TOKENMILL_LOG_LEVEL": "warning"}))
    launcher.start()
    try:
        pids = {name: svc.process.pid for name, svc in launcher.services.items() if svc.process is not None}
        result = asyncio.run(run(launcher.public_address, args.seconds, args.attackers, args.victim_streams, pids,
                                 run_dir))
    finally:
        launcher.stop()
    show(result, args.victim_streams, args.attackers)
    print(f"load average after: {os.getloadavg()[0]:.2f} (logs in {run_dir / 'logs'})")


if __name__ == "__main__":
    main()
