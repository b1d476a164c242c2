"""One tenant floods the stack with hostile requests: do the other tenant's streams all complete,
and how far does its time to first token move?

    python -m benchmarks hostile-flood [--seconds 20] [--attackers 4] [--victim-streams 2]

The stack runs as ``tokenmill up`` runs it (the Launcher, processes) with authentication
(tenants "victim" and "attacker"), serving stories260K with its config vocab padded to 1,024
rows past its tokenizer's 512 ids (services/tools/padded_vocab.py), as Qwen2-family checkpoints
ship theirs. The victim keeps ``--victim-streams`` greedy requests of 32 tokens in flight, back
to back, and times each one's first token: first alone, then while the attacker's client
process sends, from ``--attackers`` loops as fast as the answers come, in turn:

- ids past the tokenizer: token_ids naming id 550, logit_bias {550: 100}, stop_token_ids [550],
  and plain greedy requests, which on this model sample the padded rows unless they are masked;
- oversized chats: 2.5 million empty messages (12.5 MB), and 1,100 messages within the size limit;
- calls without a valid token: 16 MiB bodies, bodies just under the message limit and
  undecodable ones, with no token or a wrong one.

Prints the victim's TTFT p50/p99 alone and flooded with their ratio, how many of its streams
completed (and how the others ended), and the attacker's outcomes by kind and status; with the
command, the commit and the load average, also written to benchmarks/results/.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from benchmarks.harness import child as harness_child, flags
from benchmarks.harness.cpu import process_cpu_seconds
from benchmarks.harness.flags import setting
from benchmarks.harness.launch import LaunchSpec, executor_flags, launched, scheduler_flags
from benchmarks.harness.paths import STORIES
from benchmarks.harness.report import LoadWatch, command_line, provenance, result_path, write_result
from benchmarks.harness.stats import percentile
from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.common.server import create_channel
from services.common.settings import embedded
from services.executor.config import ExecutorConfig
from services.scheduler.core.config import SchedulerLimits
from services.stack.client import build_request
from services.tools.padded_vocab import pad_vocab

PROG = "python -m benchmarks hostile-flood"
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
    bodies.append(("120 KiB without a token", None, _field(2, b"a" * (120 << 10))))
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


def attacker(address: str, attackers: int, report: str) -> None:
    """The attacker's client process (harness.child): sends until it is terminated."""
    try:
        asyncio.run(attack(address, attackers, Path(report)))
    except KeyboardInterrupt:
        pass


async def attack(address: str, attackers: int, report: Path) -> None:
    """Sends until terminated, writing its counts to ``report`` twice a second."""
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
        process = subprocess.Popen(harness_child.command("benchmarks.hostile_flood:attacker", address=address,
                                                         attackers=attackers, report=str(report)),
                                   cwd=harness_child.CWD)
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
              f"TTFT p50 {percentile(victim_run.ttft_ms, 50):7.2f} ms  p99 {percentile(victim_run.ttft_ms, 99):7.2f} ms"
              + ("" if victim_run.completed == total else f"  other ends: {dict(victim_run.ends - Counter(length=victim_run.completed))}"))
    print("attacker's calls while flooded, by kind:")
    for kind, counts in result["attacks"].items():
        print(f"    {kind:<32} " + ", ".join(f"{code} {n}" for code, n in sorted(counts.items())))
    print(f"CPU while flooded, cores: {result['cores']}")
    print(f"victim TTFT p99 flooded / alone: {percentile(flooded.ttft_ms, 99) / percentile(alone.ttft_ms, 99):.2f}x "
          f"(p50 {percentile(flooded.ttft_ms, 50) / percentile(alone.ttft_ms, 50):.2f}x)")


@dataclass(frozen=True, slots=True)
class HostileFloodSettings:
    seconds: float = setting(20.0)
    """Seconds of the victim's requests, alone and then flooded."""
    attackers: int = setting(4)
    """The attacker's concurrent loops."""
    victim_streams: int = setting(2)
    """The victim's greedy streams in flight, back to back."""
    attention_backend: str = setting("auto")
    """The executor's attention backend (torch, cpu or auto)."""
    limits: SchedulerLimits = embedded(SchedulerLimits, env_prefix="TOKENMILL_",
                                       default=SchedulerLimits(max_num_seqs=8))
    out: str = setting("")
    """Result file (default: benchmarks/results/hostile-flood-DATE-TIME.json)."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "attackers", "victim_streams")
        flags.check_at_least(self, 0.5, "seconds")
        flags.check_choices("attention_backend", self.attention_backend, ("auto", "torch", "cpu"))
        self.limits.validate()


def _summary(victim_run: VictimRun) -> dict:
    return {"streams": sum(victim_run.ends.values()), "completed": victim_run.completed,
            "ends": dict(victim_run.ends), "ttft_p50_ms": percentile(victim_run.ttft_ms, 50),
            "ttft_p99_ms": percentile(victim_run.ttft_ms, 99)}


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    settings = flags.parse(HostileFloodSettings, argv, prog=prog, description=__doc__)
    load = LoadWatch()
    run_dir = Path(tempfile.mkdtemp(prefix="tokenmill-hostile-"))
    model = pad_vocab(STORIES, run_dir / "stories-padded", PADDED_VOCAB)
    tokens = run_dir / "tokens.json"
    tokens.write_text(json.dumps([{"token": VICTIM, "tenant": "victim"}, {"token": ATTACKER, "tenant": "attacker"}]))
    tokens.chmod(0o600)  # the scheduler refuses a tokens file others may read
    executor = ExecutorConfig(model=str(model), num_blocks=512, block_size=16, dtype="fp32", device="cpu",
                              attention_backend=settings.attention_backend)
    launch = LaunchSpec(str(model), tuple(executor_flags(executor, only_changed=True)),
                        (*scheduler_flags(settings.limits, only_changed=True), f"--auth-tokens-file={tokens}"),
                        threads=1, metrics=False, log_prefix="tokenmill-hostile-")
    with launched(launch) as stack:
        result = asyncio.run(run(stack.address, settings.seconds, settings.attackers, settings.victim_streams,
                                 stack.pids, run_dir))
    show(result, settings.victim_streams, settings.attackers)
    load.stop()
    record = {**provenance(command_line(prog, argv or []), load), "settings": {
        "seconds": settings.seconds, "attackers": settings.attackers, "victim_streams": settings.victim_streams,
        "max_num_seqs": settings.limits.max_num_seqs},
        "alone": _summary(result["alone"]), "flooded": _summary(result["flooded"]),
        "attacks": result["attacks"], "cores": result["cores"]}
    path = write_result(record, result_path("hostile-flood", settings.out or None))
    print(f"load average before/after: {load.before:.2f}/{load.after:.2f}; result: {path}")
    return 0
