"""Several executors behind one scheduler: scaling, prefill/decode disaggregation, failover.

    python -m benchmarks executors [--parts scaling,pd,failover] [--model random:llama-100m]

Each part runs its systems one after the other in one run and prints their ratios. Every
executor runs one torch thread, pinned to a core of its own with ``taskset`` (core i for the
i-th executor, modulo the cores there are), so "two executors" means two cores' worth of
model; the scheduler, tokenizer and drafter are not pinned and share the cores with them
(on a 2-core machine that is the price of running everything on it; say so with the figures).

- **scaling**: one closed-loop workload (the headline's shape: random prompts and outputs,
  greedy, EOS ignored) on one executor on one core, one executor with two threads on both
  cores, and two executors on one core each. Target: two executors ≥ 1.6x one on one core.
- **pd** (DistServe's setting): ``--pd-decode-streams`` streams of long outputs decode while
  long prompts (``--pd-prompt-len``, short outputs) arrive at ``--pd-prompt-rate`` a second.
  One prefill + one decode executor against two mixed ones at equal cores: TPOT p99 of the
  decode streams (target ≤ 0.5x), output throughput (within 10%), and goodput under
  ``--pd-tpot-slo-ms``.
- **failover**: two executors serve ``--failover-streams`` greedy streams; once a third of their
  tokens arrived, the second executor is SIGKILLed (and not restarted). Its streams move to
  the survivor by recompute. Reported: failed streams (target 0), how long the streams that
  paused waited from the kill to their next token (p50, max), and tokens/s before, during
  the pause and after.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass, replace

from benchmarks.harness import flags
from benchmarks.harness.client import generation_stub, greedy_request, stream
from benchmarks.harness.flags import setting
from benchmarks.harness.launch import LaunchSpec, executor_flags, launched
from benchmarks.harness.models import resolve_model
from benchmarks.harness.paths import STORIES
from benchmarks.harness.records import SLO, RequestRecord, SystemRun, summarize
from benchmarks.harness.report import LoadWatch, command_line, provenance, result_path, write_result
from benchmarks.harness.stats import median, percentile, ratio
from services.executor.config import ExecutorConfig
from services.stack.launcher import Launcher, ServiceProcess

PROG = "python -m benchmarks executors"
PARTS = ("scaling", "pd", "failover")


@dataclass(frozen=True)
class ExecutorsSettings:
    parts: tuple[str, ...] = setting(PARTS)
    """Which parts to run (comma-separated): scaling, pd, failover."""
    model: str = setting("random:llama-100m")
    """Model of the scaling and pd parts (a directory or random:PRESET)."""
    failover_model: str = setting(str(STORIES))
    """Model of the failover part (small: the survivor recomputes every moved stream's prompt and outputs)."""
    kv_cache_bytes: int = setting(512 * 1024**2)
    """Each executor's KV pool."""
    num_requests: int = setting(64)
    """scaling: requests."""
    concurrency: int = setting(16)
    """scaling: requests in flight."""
    prompt_len: str = setting("32:256")
    """scaling: prompt lengths, LOW:HIGH (uniform)."""
    output_len: str = setting("16:128")
    """scaling: output lengths, LOW:HIGH (uniform)."""
    pd_decode_streams: int = setting(16)
    """pd: streams decoding long outputs."""
    pd_decode_output: int = setting(128)
    """pd: tokens each decode stream generates."""
    pd_prompt_len: int = setting(768)
    """pd: length of the long prompts that arrive."""
    pd_prompts: int = setting(4)
    """pd: how many long prompts arrive."""
    pd_prompt_rate: float = setting(0.5)
    """pd: long prompts a second (Poisson arrivals)."""
    pd_tpot_slo_ms: float = setting(250.0)
    """pd: the TPOT SLO of goodput."""
    failover_streams: int = setting(32)
    """failover: streams."""
    failover_output: int = setting(256)
    """failover: tokens each stream generates."""
    seed: int = setting(0)
    """Seed of the prompts and arrivals."""
    out: str = setting("")
    """Result JSON path (default benchmarks/results/executors-DATE.json)."""

    def validate(self) -> None:
        flags.check_choices("parts", self.parts, PARTS)
        flags.check_at_least(self, 1, "num_requests", "concurrency", "pd_decode_streams", "pd_prompts",
                             "failover_streams")
        flags.check_at_least(self, 2, "failover_output", "pd_decode_output")
        for name in ("prompt_len", "output_len"):
            low, _, high = getattr(self, name).partition(":")
            if not (low.isdigit() and (not high or high.isdigit())):
                raise ValueError(f"{flags.flag(name)}: LOW:HIGH, got {getattr(self, name)!r}")


class PinnedLauncher(Launcher):
    """The launcher, each executor's command under ``taskset -c CORE`` (taskset execs it: the
    process id is the executor's)."""

    def _command(self, svc: ServiceProcess) -> list[str]:
        command = super()._command(svc)
        if svc.kind != "executor" or self.config.env.get("OMP_NUM_THREADS") != "1":
            return command
        core = self.executor_names.index(svc.name) % (os.cpu_count() or 1)
        return ["taskset", "-c", str(core), *command]


def lengths(spec: str, rng: random.Random) -> int:
    low, _, high = spec.partition(":")
    return rng.randint(int(low), int(high or low))


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def vocab_size_of(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def spec_for(model_dir: str, settings: ExecutorsSettings, roles: tuple[str, ...], threads: int) -> LaunchSpec:
    executor = ExecutorConfig(model=model_dir, dtype="fp32", device="cpu", kv_cache_bytes=settings.kv_cache_bytes)
    return LaunchSpec(model_dir, tuple(executor_flags(executor, only_changed=True)), threads=threads,
                      metrics=False, executor_roles=roles, log_prefix="tokenmill-executors-")


def new_records(items: list[tuple[float, list[int], int]]) -> list[RequestRecord]:
    return [RequestRecord(i, len(prompt), n, 0.0) for i, (_, prompt, n) in enumerate(items)]


async def timed_streams(address: str, items: list[tuple[float, list[int], int]], concurrency: int,
                        records: list[RequestRecord]) -> SystemRun:
    """``items`` (arrival offset, prompt ids, max tokens), at most ``concurrency`` in flight, read
    into ``records`` (the caller's: it may watch them fill)."""
    slots = asyncio.Semaphore(concurrency)
    async with generation_stub(address) as stub:
        await stream(stub, greedy_request([5, 6, 7, 8], 4))  # warm: connections and the first step
        start = time.perf_counter()

        async def one(index: int) -> None:
            arrival, prompt, n = items[index]
            await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - start)))
            async with slots:
                records[index].send_time = time.perf_counter()
                await stream(stub, greedy_request(prompt, n), records[index], timeout=1800)

        await asyncio.gather(*(one(i) for i in range(len(items))))
        return SystemRun("", records, start, time.perf_counter())


def run_system(spec: LaunchSpec, items, concurrency: int, during=None) -> SystemRun:
    """Start the stack, run ``items``, stop it; ``during(launcher, records, load)`` runs beside the load."""
    records = new_records(items)
    with launched(spec, PinnedLauncher) as stack:
        async def both() -> SystemRun:
            load = asyncio.ensure_future(timed_streams(stack.address, items, concurrency, records))
            if during is not None:
                await during(stack.launcher, records, load)
            return await load
        return asyncio.run(both())


def scaling(settings: ExecutorsSettings, model_dir: str) -> dict:
    rng = random.Random(settings.seed)
    vocab = vocab_size_of(model_dir)
    items = [(0.0, random_prompt(rng, lengths(settings.prompt_len, rng), vocab), lengths(settings.output_len, rng))
             for _ in range(settings.num_requests)]
    systems = {
        "one_executor_one_core": spec_for(model_dir, settings, ("mixed",), 1),
        "one_executor_two_threads": spec_for(model_dir, settings, ("mixed",), 2),
        "two_executors_one_core_each": spec_for(model_dir, settings, ("mixed", "mixed"), 1),
    }
    out = {}
    for name, spec in systems.items():
        print(f"scaling: {name} ...", flush=True)
        out[name] = summarize(run_system(spec, items, settings.concurrency), SLO())
    tps = {name: s["output_throughput_tps"] for name, s in out.items()}
    return {"systems": out,
            "two_vs_one_core": ratio(tps["two_executors_one_core_each"], tps["one_executor_one_core"]),
            "two_vs_one_two_threads": ratio(tps["two_executors_one_core_each"], tps["one_executor_two_threads"])}


def pd(settings: ExecutorsSettings, model_dir: str) -> dict:
    rng = random.Random(settings.seed + 1)
    vocab = vocab_size_of(model_dir)
    decode = [(0.0, random_prompt(rng, 32, vocab), settings.pd_decode_output) for _ in range(settings.pd_decode_streams)]
    arrivals, at = [], 1.0
    for _ in range(settings.pd_prompts):
        arrivals.append((at, random_prompt(rng, settings.pd_prompt_len, vocab), 16))
        at += rng.expovariate(settings.pd_prompt_rate)
    items = decode + arrivals
    slo = SLO(tpot_ms=settings.pd_tpot_slo_ms)
    out = {}
    for name, roles in (("two_mixed", ("mixed", "mixed")), ("one_prefill_one_decode", ("prefill", "decode"))):
        print(f"pd: {name} ...", flush=True)
        run = run_system(spec_for(model_dir, settings, roles, 1), items, len(items))
        streams = replace(run, records=run.records[:len(decode)])
        summary = summarize(run, slo)
        decode_summary = summarize(streams, slo)
        out[name] = {"all": summary, "decode_streams": {
            "tpot_ms": decode_summary["tpot_ms"], "itl_ms": decode_summary["itl_ms"],
            "good_fraction": decode_summary["good_fraction"], "goodput_rps": decode_summary["goodput_rps"]},
            "long_prompts_ttft_ms": summarize(replace(run, records=run.records[len(decode):]), slo)["ttft_ms"]}
    mixed, split = out["two_mixed"], out["one_prefill_one_decode"]
    return {"systems": out,
            "tpot_p99_ratio": ratio(split["decode_streams"]["tpot_ms"]["p99"], mixed["decode_streams"]["tpot_ms"]["p99"]),
            "itl_p99_ratio": ratio(split["decode_streams"]["itl_ms"]["p99"], mixed["decode_streams"]["itl_ms"]["p99"]),
            "throughput_ratio": ratio(split["all"]["output_throughput_tps"], mixed["all"]["output_throughput_tps"])}


def failover(settings: ExecutorsSettings, model_dir: str) -> dict:
    rng = random.Random(settings.seed + 2)
    vocab = vocab_size_of(model_dir)
    items = [(0.0, random_prompt(rng, rng.randint(8, 32), vocab), settings.failover_output)
             for _ in range(settings.failover_streams)]
    expected = sum(n for _, _, n in items)
    killed: dict[str, float] = {}

    async def kill_after_a_third(launcher: Launcher, records: list[RequestRecord], load: asyncio.Future) -> None:
        while not load.done():
            if sum(r.num_output_tokens for r in records) >= expected / 3:
                launcher.services["executor-1"].process.send_signal(signal.SIGKILL)
                killed["at"] = time.perf_counter()
                return
            await asyncio.sleep(0.005)

    print("failover: two executors, the second killed a third of the way ...", flush=True)
    run = run_system(spec_for(model_dir, settings, ("mixed", "mixed"), 1), items, len(items), kill_after_a_third)
    at = killed.get("at")
    summary = summarize(run, SLO())
    # Every stream in flight at the kill: the time from the kill to its next token. Those whose
    # wait is over 5x their own median inter-token gap count as paused (the moved ones); the
    # largest wait of all is when the last of them resumed, however short the pause was.
    waits, gaps = [], []
    for record in run.records:
        after = [t for t in record.chunk_times if at is not None and t > at]
        before = [t for t in record.chunk_times if at is not None and t <= at]
        if after and before:
            gap = after[0] - at
            gaps.append(gap)
            typical = median(record.itl_s()) if len(record.chunk_times) > 2 else 0.0
            if gap > 5 * typical:
                waits.append(gap)
    resumed_at = at + max(gaps) if at is not None and gaps else None

    def rate(lo: float, hi: float) -> float | None:
        if hi <= lo:
            return None
        tokens = sum(size for r in run.records for t, size in zip(r.chunk_times, r.chunk_sizes) if lo <= t < hi)
        return tokens / (hi - lo)

    return {"summary": summary, "killed_after_s": None if at is None else at - run.start,
            "streams_paused": len(waits), "failed_streams": summary["failed"],
            "pause_ms": {"p50": percentile([w * 1000 for w in waits], 50) if waits else None,
                         "max": max(waits) * 1000 if waits else None},
            "in_flight_at_kill": len(gaps),
            "next_token_after_kill_ms": {"p50": percentile([g * 1000 for g in gaps], 50) if gaps else None,
                                         "max": max(gaps) * 1000 if gaps else None},
            "tokens_per_s": {"before": rate(run.start, at) if at else None,
                             "during_pause": rate(at, resumed_at) if resumed_at else None,
                             "after": rate(resumed_at, run.end) if resumed_at else None}}


def print_report(result: dict) -> None:
    def fmt(value, spec=".2f"):
        return "n/a" if value is None else format(value, spec)

    if "scaling" in result:
        s = result["scaling"]
        for name, summary in s["systems"].items():
            print(f"scaling {name:<28} {summary['output_throughput_tps']:8.1f} tok/s  "
                  f"TPOT p50 {summary['tpot_ms']['p50']:.1f} ms  failed {summary['failed']}")
        print(f"scaling: two executors / one on one core {fmt(s['two_vs_one_core'])}x (target 1.6), "
              f"/ one on two threads {fmt(s['two_vs_one_two_threads'])}x")
    if "pd" in result:
        p = result["pd"]
        for name, system in p["systems"].items():
            d = system["decode_streams"]
            print(f"pd {name:<24} TPOT p50 {d['tpot_ms']['p50']:.1f} p99 {d['tpot_ms']['p99']:.1f} ms  ITL p99 "
                  f"{d['itl_ms']['p99']:.1f} ms  {system['all']['output_throughput_tps']:.1f} tok/s  "
                  f"good {d['good_fraction']:.2f}  long-prompt TTFT p50 {system['long_prompts_ttft_ms']['p50']:.0f} ms")
        print(f"pd: 1P+1D / 2 mixed: TPOT p99 {fmt(p['tpot_p99_ratio'])}x (target <= 0.5), ITL p99 "
              f"{fmt(p['itl_p99_ratio'])}x, throughput {fmt(p['throughput_ratio'])}x (target within 10%)")
    if "failover" in result:
        f = result["failover"]
        t = f["tokens_per_s"]
        n = f['next_token_after_kill_ms']
        print(f"failover: killed at {fmt(f['killed_after_s'])} s, {f['streams_paused']} streams paused, "
              f"{f['failed_streams']} failed; pause p50 {fmt(f['pause_ms']['p50'], '.0f')} ms max "
              f"{fmt(f['pause_ms']['max'], '.0f')} ms; tok/s before {fmt(t['before'], '.0f')}, during "
              f"{fmt(t['during_pause'], '.0f')}, after {fmt(t['after'], '.0f')}; next token after the kill "
              f"({f['in_flight_at_kill']} streams in flight) p50 {fmt(n['p50'], '.0f')} ms max {fmt(n['max'], '.0f')} ms")


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    settings = flags.parse(ExecutorsSettings, argv, prog=prog, description=__doc__)
    load = LoadWatch()
    result: dict = {}
    if "scaling" in settings.parts:
        result["scaling"] = scaling(settings, resolve_model(settings.model))
    if "pd" in settings.parts:
        result["pd"] = pd(settings, resolve_model(settings.model))
    if "failover" in settings.parts:
        result["failover"] = failover(settings, resolve_model(settings.failover_model))
    result |= provenance(command_line(prog, argv or []), load)
    print_report(result)
    path = write_result(result, result_path("executors", settings.out or None))
    print(f"wrote {path}")
    return 0
