"""The stress suite: hundreds of concurrent streams under abuse, then a check that nothing leaked.

    python -m benchmarks stress [--seconds 600] [--streams 200]      (make stress STRESS_SECONDS=...)

The stack runs as `tokenmill up` runs it (the Launcher: four processes, restarts on). For
``--seconds``, ``--streams`` client tasks each run greedy streams back to back, each stream
picking at random what its client does:

- complete: read to the end; the tokens must equal the solo run of the same prompt (taken
  through the same stack before the load starts) and the Finished usage must count them;
- cancel: cancel after a random number of deltas;
- deadline: a client deadline that passes mid-stream (DEADLINE_EXCEEDED is expected);
- and, on the side, a client process SIGKILLed mid-stream every few seconds, a burst of
  ``--burst`` calls at once every ``--burst-every`` seconds from a client process of its own
  (RESOURCE_EXHAUSTED latency is timed there, issue to status), and one SIGKILL of the executor halfway (``--kill-executor-at``; the launcher
  restarts it). The streams it cuts pause while the scheduler waits for it (``--executor-wait-s``)
  and then complete, their tokens equal to their solo runs; one that waits past that ends with
  exactly one Finished, reason error, its tokens so far a prefix of its solo run's.

Crashes are service processes that exited other than the executor we killed, and answers a
client must never see (UNKNOWN, INTERNAL, a stream without exactly one Finished, an error
after partial output). Leaked blocks are KV blocks still in use once idle (GetProfile), lost
or duplicated tokens the differences of completed streams from their solo runs plus usage
counts that disagree with the tokens received. Resident memory and thread counts of each
service are read from /proc once idle (3 s after the last stream, so the scheduler's trim when
it goes idle has run): after the solo runs ("cold"), after ``--warmup-seconds``
of the same streams and bursts ("before": the allocators have then reached their high-water
mark for this load; the scheduler's idle RSS grows ~11% over its cold value in the first
30 s of load, 4 of its 6 MiB pymalloc arenas that fragmentation keeps, not live objects), and
after the run ("after"); growth is after over before. The run is split into ``--rounds``
(2) with an idle reading after each, so a leak (growth in every round) can be told from a
high-water mark still being reached (growth in the first round only). ``--trace-memory DIR`` writes what the
scheduler's memory is made of at those readings and every minute (benchmarks/memtrace/);
``--heaptrack DIR`` runs the scheduler under heaptrack (every malloc with its C call stack, to
read with ``heaptrack_print``; its resident memory then includes heaptrack's own);
``--scheduler-env NAME=VALUE`` (repeatable) sets a variable for the scheduler alone (``PYTHONMALLOC=malloc``).
The table also gives each service's CPU seconds during the run, and a throughput line the
tokens the clients received per second and the scheduler's CPU time per token (on a shared
machine the CPU time compares better between runs than the wall-clock rates). Then the summary line

    stress: <N> streams, <c> crashes, <l> leaked blocks, <t> lost or duplicated tokens, overload p99 <ms> ms
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import grpc

from benchmarks.harness import child as harness_child, flags
from benchmarks.harness.bursts import BurstResult, burst, one_by_one
from benchmarks.harness.client import generation_stub, greedy_request
from benchmarks.harness.cpu import ProcStatus, proc_status
from benchmarks.harness.flags import setting
from benchmarks.harness.launch import LaunchSpec, executor_flags, launched, scheduler_flags
from benchmarks.harness.paths import BENCHMARKS, REPO_ROOT, STORIES as _STORIES
from benchmarks.harness.stats import percentile
from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2
from services.executor.config import ExecutorConfig
from services.scheduler.core.config import SchedulerLimits
from services.stack.launcher import LaunchConfig, Launcher, ServiceProcess, health_status

PROG = "python -m benchmarks stress"
STORIES = str(_STORIES)
PROMPTS = ["Once upon a time", "The cat", "Lily wanted", "Tom and his dog", "One day, a little bird",
           "The sun was hot", "Ben saw a big", "Mom said", "The little girl", "A fish swam", "The tree was tall",
           "Sam had a red ball", "It was a rainy day", "The king", "Two friends", "Max ran fast"]
MAX_TOKENS = (8, 32, 96)
NUM_BLOCKS = 1024
KILLED_CLIENT = """
import sys, grpc
from services.common.pb.tokenmill.v1 import generation_pb2_grpc
from services.stack.client import build_request
stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(sys.argv[1]))
for message in stub.Generate(build_request("Once upon a time", max_tokens=400, temperature=0.0, ignore_eos=True)):
    print(message.WhichOneof("event"), flush=True)
"""


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)
    lost_or_duplicated: int = 0
    streams: int = 0
    tokens: int = 0
    """Tokens the clients received, every stream counted (the throughput figure)."""
    overload: BurstResult = field(default_factory=BurstResult)
    killed_clients: int = 0
    executor_killed_at: float | None = None


def request(prompt: str, max_tokens: int) -> generation_pb2.GenerateRequest:
    return greedy_request(prompt, max_tokens)


async def solo_runs(stub) -> dict[tuple[str, int], list[int]]:
    refs = {}
    for prompt in PROMPTS:
        for max_tokens in MAX_TOKENS:
            ids = []
            async for message in stub.Generate(request(prompt, max_tokens), timeout=60):
                if message.WhichOneof("event") == "delta":
                    ids += message.delta.token_ids
            refs[(prompt, max_tokens)] = ids
    return refs


async def one_stream(stub, refs, rng: random.Random, tally: Tally) -> None:
    prompt, max_tokens = rng.choice(PROMPTS), rng.choice(MAX_TOKENS)
    action = rng.choices(["complete", "cancel", "deadline"], weights=[6, 2, 2])[0]
    timeout = rng.uniform(0.05, 1.0) if action == "deadline" else 120
    cancel_after = rng.randint(1, max(1, max_tokens // 2)) if action == "cancel" else None
    call = stub.Generate(request(prompt, max_tokens), timeout=timeout)
    kinds, ids, finished = [], [], None
    tally.streams += 1
    try:
        async for message in call:
            kind = message.WhichOneof("event")
            kinds.append(kind)
            if kind == "delta":
                ids += message.delta.token_ids
                tally.tokens += len(message.delta.token_ids)
                if cancel_after is not None and len(ids) >= cancel_after:
                    call.cancel()
                    tally.outcomes["cancelled by the client"] += 1
                    return
            elif kind == "finished":
                finished = message.finished
    except grpc.aio.AioRpcError as err:
        code = err.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and action == "deadline":
            tally.outcomes["deadline passed"] += 1
        elif code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE) and not kinds:
            tally.outcomes[f"refused: {code.name}"] += 1  # before Started: a clean refusal
            await asyncio.sleep(rng.uniform(0.05, 0.2))  # as a retrying client would back off
        elif code == grpc.StatusCode.CANCELLED and cancel_after is not None:
            tally.outcomes["cancelled by the client"] += 1
        else:
            tally.crashes.append(f"{code.name} after {kinds.count('delta')} deltas: {err.details()}")
        return
    if kinds.count("finished") != 1 or kinds[0] != "started" or kinds[-1] != "finished":
        tally.crashes.append(f"badly framed stream: {kinds[:3]}..{kinds[-3:]}")
        return
    if finished.usage.completion_tokens != len(ids):
        tally.lost_or_duplicated += abs(finished.usage.completion_tokens - len(ids))
    reason = common_pb2.FinishReason.Name(finished.finish_reason)
    if finished.finish_reason == common_pb2.FINISH_REASON_ERROR:  # cut by the executor restart
        tally.outcomes["ended by the executor restart (Finished error)"] += 1
        ref = refs[(prompt, max_tokens)]
        if ids != ref[:len(ids)]:
            tally.lost_or_duplicated += _differences(ids, ref[:len(ids)])
        return
    ref = refs[(prompt, max_tokens)]
    if ids != ref:
        tally.lost_or_duplicated += _differences(ids, ref)
    tally.outcomes[f"completed ({reason.lower().removeprefix('finish_reason_')})"] += 1


def _differences(got: list[int], want: list[int]) -> int:
    return sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))


async def client(stub, refs, seed: int, stop_at: float, tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        await one_stream(stub, refs, rng, tally)


async def burst_loop(stub, n: int, every: float, stop_at: float) -> BurstResult:
    total = BurstResult()
    while time.monotonic() + every < stop_at:
        await asyncio.sleep(every)
        sent_at = time.monotonic()  # CLOCK_MONOTONIC: the same clock in every process
        result = await burst(stub, n)
        if result.refused_ms:
            result.bursts.append((sent_at, max(result.refused_ms)))
        total.add(result)
    return total


def tally_bursts(result: BurstResult, tally: Tally) -> None:
    tally.overload.add(BurstResult(result.refused_ms, result.admitted, [], result.without_pushback, result.bursts))
    for name in result.other:
        if name not in ("UNAVAILABLE",):
            tally.crashes.append(f"burst call answered {name}")


async def overload_bursts(stub, address: str, n: int, every: float, stop_at: float, tally: Tally,
                          in_process: bool) -> None:
    """Bursts of ``n`` calls at once every ``every`` seconds until ``stop_at``.

    By default from a client process of their own, as another client would send them: from
    this process, the answers wait for an event loop that also reads the clients' hundreds of
    streams, and the overload latency measures this benchmark's own loop more than the server
    (``--burst-client same`` keeps that setup, for comparison).
    """
    if in_process:
        tally_bursts(await burst_loop(stub, n, every, stop_at), tally)
        return
    command = harness_child.command("benchmarks.stress:burst_client", address=address, n=n, every=every,
                                    seconds=max(0.0, stop_at - time.monotonic()))
    process = await asyncio.create_subprocess_exec(
        *command, cwd=harness_child.CWD, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=subprocess.PIPE)
    out, _ = await process.communicate()
    if process.returncode != 0:
        tally.crashes.append(f"the burst client exited {process.returncode}")
        return
    tally_bursts(BurstResult(**harness_child.result(out.decode())), tally)


def burst_client(address: str, n: int, every: float, seconds: float) -> dict:
    """The burst client process (harness.child): its bursts' results."""
    async def run() -> BurstResult:
        stop_at = time.monotonic() + seconds
        async with generation_stub(address) as stub:
            await one_by_one(stub, 3)  # a connected channel: the first burst must not time its handshake
            return await burst_loop(stub, n, every, stop_at)

    return asdict(asyncio.run(run()))


async def killed_clients(address: str, every: float, stop_at: float, tally: Tally) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    while time.monotonic() + every < stop_at:
        await asyncio.sleep(every)
        process = await asyncio.create_subprocess_exec(sys.executable, "-c", KILLED_CLIENT, address, env=env,
                                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            for _ in range(3):  # started + two deltas: mid-stream
                await asyncio.wait_for(process.stdout.readline(), 30)
        except asyncio.TimeoutError:
            pass
        if process.returncode is None:
            try:
                process.send_signal(signal.SIGKILL)
                tally.killed_clients += 1
            except ProcessLookupError:  # it ended on its own (refused while the executor restarted)
                pass
        await process.wait()


class StressLauncher(Launcher):
    """The launcher, with one service optionally run under heaptrack (``--heaptrack DIR``).

    The service's command is prefixed with ``heaptrack -o DIR/<name>``. heaptrack's script runs
    the service as its child and writes the profile once it exits, so ``pid`` finds that child
    (for the /proc readings and the memory tracer's signals), and ``stop`` ends the service
    itself first and waits for the script: a SIGTERM to the script would leave the service
    running and the profile unwritten."""

    PROFILE_WRITE_S = 300.0
    """How long stop waits for heaptrack to write its profile after the service exits."""

    def __init__(self, config: LaunchConfig, heaptrack_dir: str = "", heaptrack_service: str = "scheduler",
                 scheduler_env: dict[str, str] | None = None) -> None:
        super().__init__(config)
        self.heaptrack_dir = heaptrack_dir
        self.heaptrack_service = heaptrack_service
        self.scheduler_env = scheduler_env or {}
        """Variables for the scheduler alone, set by ``env`` (which execs: the process id is the service's)."""

    def _command(self, svc: ServiceProcess) -> list[str]:
        command = super()._command(svc)
        name = svc.kind
        if name == "scheduler" and self.scheduler_env:
            command = ["env", *(f"{k}={v}" for k, v in self.scheduler_env.items()), *command]
        if self.heaptrack_dir and name == self.heaptrack_service:
            heaptrack = shutil.which("heaptrack")
            if heaptrack is None:
                raise RuntimeError("--heaptrack: no heaptrack on PATH")
            return [heaptrack, "-o", os.path.join(self.heaptrack_dir, name), *command]
        return command

    def pid(self, name: str) -> int:
        """The service's own process id (under heaptrack: the child of its script)."""
        wrapper = self.services[name].process.pid
        if not (self.heaptrack_dir and name == self.heaptrack_service):
            return wrapper
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            if ppid == wrapper and f"services.{name}".encode() in argv:
                return int(entry)
        raise RuntimeError(f"no {name} process under heaptrack (pid {wrapper})")

    def stop(self, timeout: float = 15.0) -> None:
        svc = self.services.get(self.heaptrack_service) if self.heaptrack_dir else None
        if svc is not None and svc.process is not None and svc.process.poll() is None:
            with self._spawn_lock:
                self._stopping.set()  # the script ends with the service: no restart
            try:
                os.kill(self.pid(svc.name), signal.SIGTERM)
                svc.process.wait(self.PROFILE_WRITE_S)
            except (RuntimeError, ProcessLookupError, subprocess.TimeoutExpired) as exc:
                print(f"heaptrack: the {svc.name} did not end cleanly ({exc!r})", file=sys.stderr)
        super().stop(timeout)


KILL_AFTER_ROUND_START_S = 5.0
"""The earliest an executor kill comes in a round: at a round's first instant its 200 streams have
only just been sent, so none would be in flight to end with Finished (error)."""


def kill_placement(seconds: float, rounds: int, fraction: float) -> tuple[int, float]:
    """(the round the executor kill falls in, seconds into it) for a kill at ``fraction`` of
    ``seconds`` split into ``rounds``; (-1, 0.0) for a negative fraction (no kill). A kill at a
    round's boundary goes into the round after it, KILL_AFTER_ROUND_START_S in (or half the
    round, if shorter); one at the very end stays at the end of the last round."""
    if fraction < 0:
        return -1, 0.0
    round_s = seconds / rounds
    kill_round = min(int(seconds * fraction // round_s), rounds - 1)
    at = seconds * fraction - kill_round * round_s
    return kill_round, min(max(at, min(KILL_AFTER_ROUND_START_S, round_s / 2)), round_s)


async def kill_executor_at(launcher: StressLauncher, at: float, tally: Tally) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    tally.executor_killed_at = time.monotonic()
    os.kill(launcher.pid("executor"), signal.SIGKILL)


IDLE_SETTLE_S = 3.0
"""How long the stack is left idle before its memory is read: the scheduler gives free memory
back (malloc_trim) once it has made no step for a second or two."""


async def trace_memory(launcher: Launcher, args, sig: signal.Signals) -> None:
    """Ask the traced service for a line now (SIGUSR2), or after malloc_trim (SIGUSR1), and give
    it time to write it before its memory is read."""
    if args.trace_memory:
        os.kill(launcher.pid(args.trace_service), sig)
        await asyncio.sleep(2.0)


async def settle_and_trace(launcher: Launcher, args) -> None:
    """Leave the stack idle for IDLE_SETTLE_S, then take the traced service's line."""
    await asyncio.sleep(IDLE_SETTLE_S)
    await trace_memory(launcher, args, signal.SIGUSR2)


async def wait_idle(stub, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        profile = await stub.GetProfile(generation_pb2.GetProfileRequest(), timeout=10)
        if (profile.num_running == profile.num_waiting == 0 and profile.kv_cache_usage == 0) \
                or time.monotonic() > deadline:
            return profile
        await asyncio.sleep(0.1)


def readings(launcher: Launcher) -> dict[str, ProcStatus]:
    return {name: proc_status(launcher.pid(name)) for name in launcher.services}


async def warm_up(stub, refs, launcher: StressLauncher, args, tally: Tally) -> None:
    """The same load for a while first: the allocators' high-water mark for this load (pymalloc
    arenas, gRPC's buffers) is reached before the baseline is read, so the growth measured after
    is what further load adds, which is what a leak is."""
    address = launcher.public_address
    warm_tally = Tally()
    warm_stop = time.monotonic() + args.warmup_seconds
    side = [asyncio.create_task(overload_bursts(stub, address, args.burst,
                                                min(args.burst_every, args.warmup_seconds / 2), warm_stop,
                                                warm_tally, args.burst_client == "same"))]
    await asyncio.gather(*(client(stub, refs, -1 - seed, warm_stop, warm_tally) for seed in range(args.streams)))
    await asyncio.gather(*side)
    tally.crashes += [f"warm-up: {crash}" for crash in warm_tally.crashes]
    tally.lost_or_duplicated += warm_tally.lost_or_duplicated
    await wait_idle(stub)
    await settle_and_trace(launcher, args)


async def load_rounds(stub, refs, launcher: StressLauncher, args, tally: Tally):
    """The measured load in --rounds: (seconds under load, each round's idle reading but the
    last, the scheduler's profile once idle after the last)."""
    address = launcher.public_address
    round_s = args.seconds / args.rounds
    kill_round, kill_at = kill_placement(args.seconds, args.rounds, args.kill_executor_at)
    load_s = 0.0
    between: list[dict[str, ProcStatus]] = []
    for index in range(args.rounds):
        round_start = time.monotonic()
        stop_at = round_start + round_s
        side = [asyncio.create_task(overload_bursts(stub, address, args.burst, args.burst_every, stop_at, tally,
                                                    args.burst_client == "same")),
                asyncio.create_task(killed_clients(address, args.kill_client_every, stop_at, tally)),
                *([asyncio.create_task(kill_executor_at(launcher, round_start + kill_at, tally))]
                  if index == kill_round else [])]
        await asyncio.gather(*(client(stub, refs, seed + index * args.streams, stop_at, tally)
                               for seed in range(args.streams)))
        await asyncio.gather(*side)
        load_s += time.monotonic() - round_start
        # The executor's restart must be done and every stream gone before the leak check.
        deadline = time.monotonic() + 60
        while health_status(address, "tokenmill.v1.Generation") != "SERVING" and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        profile = await wait_idle(stub)
        if index < args.rounds - 1:
            await settle_and_trace(launcher, args)
            between.append(readings(launcher))
    return load_s, between, profile


def check_exits(launcher: StressLauncher, args, tally: Tally) -> int:
    """Crashes for every exit but the planned executor kills; the number of planned kills."""
    for event in launcher.events:
        if "exited" in event and not event.startswith("executor"):
            tally.crashes.append(event)
    executor_exits = sum(1 for e in launcher.events if e.startswith("executor exited"))
    planned = 1 if args.kill_executor_at >= 0 else 0
    if executor_exits != planned:
        tally.crashes.append(f"the executor exited {executor_exits} times ({planned} expected: the planned kills)")
    return planned


def print_outcomes(tally: Tally, started: float) -> None:
    print(f"{'outcome':<52}{'streams':>10}")
    for outcome, n in sorted(tally.outcomes.items()):
        print(f"{outcome:<52}{n:>10}")
    print(f"{'clients SIGKILLed mid-stream':<52}{tally.killed_clients:>10}")
    ms = tally.overload.refused_ms
    print(f"{'overload burst calls refused (RESOURCE_EXHAUSTED)':<52}{len(ms):>10}")
    print(f"{'  ... admitted anyway / without pushback':<52}{tally.overload.admitted:>5} /{tally.overload.without_pushback:>3}")
    print(f"{'  ... p50 / p99 / max ms':<52}{percentile(ms, 50):>8.2f} / {percentile(ms, 99):.2f} / "
          f"{max(ms) if ms else float('nan'):.2f}")
    slowest = sorted(tally.overload.bursts, key=lambda b: -b[1])[:3]
    if slowest:
        killed = (f"; the executor was killed at {tally.executor_killed_at - started:.0f} s"
                  if tally.executor_killed_at is not None else "")
        print("  ... slowest bursts (sent at, slowest refusal): "
              + ", ".join(f"{at - started:.0f} s {slow:.0f} ms" for at, slow in slowest) + killed)


def print_memory(cold: dict, before: dict, after: dict, between: list[dict], args, planned: int) -> None:
    print(f"RSS once idle: cold = after the solo runs; before = after {args.warmup_seconds:.0f} s of warm-up load; "
          f"after = after the {args.seconds:.0f} s run")
    print(f"{'service':<12}{'RSS cold MiB':>14}{'RSS before MiB':>16}{'RSS after MiB':>16}{'growth':>9}"
          f"{'threads before':>16}{'threads after':>15}{'CPU s in run':>14}")
    for name in before:
        (rss0, thr0, cpu0), (rss1, thr1, cpu1) = before[name], after[name]
        restarted = planned > 0 and name == "executor"
        cpu = f"{cpu1:.1f}*" if restarted else f"{cpu1 - cpu0:.1f}"
        print(f"{name:<12}{cold[name][0] / 1024:>14.1f}{rss0 / 1024:>16.1f}{rss1 / 1024:>16.1f}"
              f"{(rss1 - rss0) / rss0 * 100:>8.1f}%{thr0:>16}{thr1:>15}{cpu:>14}{' (restarted)' if restarted else ''}")
    if planned:
        print("(* the restarted executor's CPU seconds since its restart)")
    if between:
        # A leak grows by about as much in every round; allocators reaching their high-water
        # mark grow in the first rounds and then level off.
        print(f"RSS once idle after each of {args.rounds} rounds of {args.seconds / args.rounds:.0f} s, "
              f"MiB (growth over before):")
        for name in before:
            cells = "  ".join(f"{r[name][0] / 1024:.1f} ({(r[name][0] - before[name][0]) / before[name][0] * 100:+.1f}%)"
                              for r in [*between, after])
            print(f"  {name:<10}{cells}")


def print_traces(args) -> None:
    if args.trace_memory:
        print(f"memory trace of the {args.trace_service}: {args.trace_memory} (benchmarks/memtrace/show.py prints it)")
    if args.heaptrack:
        print(f"heaptrack profile of the {args.trace_service}: {args.heaptrack} (written when it stops; "
              f"heaptrack_print reads it; its RSS above includes heaptrack's own)")


async def run(launcher: StressLauncher, args) -> int:
    tally = Tally()
    async with generation_stub(launcher.public_address) as stub:
        refs = await solo_runs(stub)
        await settle_and_trace(launcher, args)
        cold = readings(launcher)
        if args.warmup_seconds > 0:
            await warm_up(stub, refs, launcher, args, tally)
        before = readings(launcher)
        started = time.monotonic()
        elapsed, between, profile = await load_rounds(stub, refs, launcher, args, tally)
        leaked = round(profile.kv_cache_usage * NUM_BLOCKS)
        if profile.num_running or profile.num_waiting:
            tally.crashes.append(f"not idle after the load: {profile.num_running} running, "
                                 f"{profile.num_waiting} waiting")
        await settle_and_trace(launcher, args)
        after = readings(launcher)
        await trace_memory(launcher, args, signal.SIGUSR1)  # what malloc_trim(0) gives back now
    planned = check_exits(launcher, args, tally)
    print(f"\nstress: {elapsed:.0f} s, {args.streams} concurrent clients, stories260K, "
          f"{os.cpu_count()} CPUs (shared machine: absolute figures are noisy)")
    print_outcomes(tally, started)
    print_memory(cold, before, after, between, args, planned)
    completed = sum(n for outcome, n in tally.outcomes.items() if outcome.startswith("completed"))
    scheduler_cpu = after["scheduler"][2] - before["scheduler"][2]
    print(f"throughput: {tally.tokens / elapsed:.0f} tokens/s to the clients, {completed / elapsed:.1f} completed "
          f"streams/s; scheduler CPU {scheduler_cpu:.1f} s = {scheduler_cpu / max(tally.tokens, 1) * 1e6:.0f} us "
          f"a token received")
    print_traces(args)
    for crash in tally.crashes[:20]:
        print("crash:", crash)
    p99 = percentile(tally.overload.refused_ms, 99)
    print(f"stress: {tally.streams} streams, {len(tally.crashes)} crashes, {leaked} leaked blocks, "
          f"{tally.lost_or_duplicated} lost or duplicated tokens, overload p99 {p99:.1f} ms")
    return 1 if tally.crashes or leaked or tally.lost_or_duplicated else 0


@dataclass(frozen=True, slots=True)
class StressSettings:
    seconds: float = setting(600.0, env="STRESS_SECONDS")
    """Seconds of load, split into --rounds."""
    streams: int = setting(200)
    """Concurrent client tasks."""
    burst: int = setting(200)
    """Calls in one overload burst."""
    burst_every: float = setting(15.0)
    """Seconds between overload bursts."""
    kill_client_every: float = setting(5.0)
    """Seconds between clients SIGKILLed mid-stream."""
    warmup_seconds: float = setting(30.0)
    """The same load (streams and bursts) before the memory baseline is read; 0 = none."""
    kill_executor_at: float = setting(0.5)
    """When to SIGKILL the executor, as a fraction of --seconds (one at a round's start comes
    5 s into it, KILL_AFTER_ROUND_START_S, while its streams run); negative = never."""
    trace_memory: str = setting("")
    """Trace one service's memory into this directory (benchmarks/memtrace/sitecustomize.py): a JSON line every
    TOKENMILL_MEMTRACE_EVERY seconds (60) and at cold, before, after."""
    trace_service: str = setting("scheduler")
    """The service --trace-memory and --heaptrack trace."""
    scheduler_env: tuple[str, ...] = setting((), repeat=True)
    """NAME=VALUE: an environment variable for the scheduler process only (repeatable), e.g. PYTHONMALLOC=malloc."""
    heaptrack: str = setting("")
    """Run that service under heaptrack, writing DIR/<service>.zst (heaptrack_print reads it: leaked and peak
    allocations with their C stacks)."""
    rounds: int = setting(2)
    """Split --seconds into this many rounds, reading every service's idle RSS after each: a leak grows in every
    round, a high-water mark levels off."""
    burst_client: str = setting("process")
    """Send the overload bursts from a client process of their own (process), or from this one (same), whose event
    loop also reads every stream."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "rounds", "streams", "burst")
        flags.check_choices("burst_client", self.burst_client, ("process", "same"))
        bad = [item for item in self.scheduler_env if "=" not in item]
        if bad:
            raise ValueError(f"--scheduler-env: expected NAME=VALUE, got {', '.join(bad)}")

    def launch(self) -> LaunchSpec:
        env, python_path = (), None
        if self.trace_memory:
            python_path = str(BENCHMARKS / "memtrace")
            env = (("TOKENMILL_MEMTRACE_DIR", os.path.abspath(self.trace_memory)),
                   ("TOKENMILL_MEMTRACE_SERVICE", self.trace_service))
        executor = ExecutorConfig(model=STORIES, num_blocks=NUM_BLOCKS, block_size=16, dtype="fp32", device="cpu")
        # A queue the client tasks alone do not fill, so the bursts are what overflows it.
        limits = SchedulerLimits(max_num_seqs=128, max_waiting_requests=max(1, self.streams // 2))
        return LaunchSpec(STORIES, tuple(executor_flags(executor, only_changed=True)),
                          tuple(scheduler_flags(limits, only_changed=True)), threads=1, restart=True, metrics=False,
                          env=env, python_path=python_path, log_prefix="tokenmill-stress-")


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    settings = flags.parse(StressSettings, argv, prog=prog, description=__doc__)
    if settings.trace_memory:
        os.makedirs(settings.trace_memory, exist_ok=True)
    if settings.heaptrack:
        os.makedirs(settings.heaptrack, exist_ok=True)
    with launched(settings.launch(), StressLauncher,
                  heaptrack_dir=os.path.abspath(settings.heaptrack) if settings.heaptrack else "",
                  heaptrack_service=settings.trace_service,
                  scheduler_env=dict(item.split("=", 1) for item in settings.scheduler_env)) as stack:
        return asyncio.run(run(stack.launcher, settings))
