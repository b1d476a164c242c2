"""``make bench-gateway``: the gateway's four questions, answered in one run with ratios.

    python -m benchmarks gateway [--parts overhead,policies,goodput,decision,throughput] [--quick] [--no-peers]
                                 [--overhead-engine stories|sim]

1. overhead    HTTP through the gateway against the engine's gRPC API directly (stories260K, or one
               simulated engine): TTFT p50 and p99 added (and the gateway's gRPC API's, the hop
               alone), 32-stream tokens/s ratio, the gateway's CPU per token, the load average.
2. policies    five routing policies and the real peers (peers.py: LiteLLM's Router with four
               strategies, Portkey's gateway with two weightings) on one simulated heterogeneous
               pool, one Poisson trace: SLA attainment, cost, response times (SLA-free too), the
               estimate's error, and tokenmill's ratios to the best baseline and best real peer.
   goodput     the same policies and peers over ascending arrival rates: the highest rate at which
               >= 90 % of SLA requests meet their SLA (DistServe's goodput), and tokenmill's ratio.
3. decision    one routing decision with 64 targets: p50/p99, wall and CPU time.
4. throughput  routed requests/s of one gateway process on one core against simulated targets.

Prints the report (with the command, commit and load average, which the figures depend on)
and writes it as JSON to --out (default benchmarks/results/gateway-DATE.json).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass

from benchmarks.gateway import decision, overhead, peers, policies, throughput
from benchmarks.gateway.workload import poisson_trace
from benchmarks.harness import flags, report as harness_report
from benchmarks.harness.flags import setting
from services.common.logging import configure_logging

PROG = "python -m benchmarks gateway"
PARTS = ("overhead", "policies", "goodput", "decision", "throughput")


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    parts: tuple[str, ...] = setting(PARTS, choices=PARTS)
    """Which parts to run, comma-separated."""
    quick: bool = setting(False)
    """Shorter runs (a smoke test, not figures)."""
    rate: float = setting(16.0)
    """requests/s of the routing workload."""
    seconds: float = setting(30.0)
    """Length of the routing workload's trace."""
    peers: bool = setting(True)
    """Run the real peers (LiteLLM's Router, Portkey's gateway), installed at pinned versions into
    TOKENMILL_BENCH_CACHE (default ~/.cache/tokenmill/bench-peers)."""
    goodput_rates: tuple[float, ...] = setting((2.0, 4.0, 8.0, 12.0, 16.0, 24.0))
    """Arrival rates (requests/s, ascending) the goodput search tries."""
    goodput_seconds: float = setting(20.0)
    """Length of each goodput trace, after its warm-up."""
    goodput_warmup_s: float = setting(10.0)
    """Seconds of warm-up requests before each goodput trace (sent, not counted: the routers learn their targets
    first)."""
    start_timeout: float = setting(600.0)
    """Seconds the overhead part's stack and gateway may take to start (a service that exits while starting
    fails at once; a loaded machine can take minutes to start a healthy one)."""
    overhead_engine: str = setting("stories", choices=("stories", "sim"))
    """The overhead part's engine: the stories260K stack, or one simulated engine (no model: the gateway's
    share of the TTFT without the engine's CPU and variance beside it)."""
    out: str | None = setting(None)
    """Where the JSON report goes (none: benchmarks/results/gateway-DATE.json)."""

    def validate(self) -> None:
        flags.check_choices("parts", self.parts, PARTS)
        if self.start_timeout <= 0:
            raise ValueError(f"start_timeout must be > 0 seconds, got {self.start_timeout}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def _overhead(quick: bool, start_timeout_s: float, engine: str) -> dict:
    r = overhead.measure(rounds=2 if quick else 4, ttft_requests=10 if quick else 20, start_timeout_s=start_timeout_s,
                         engine=engine)
    print(f"\n## HTTP overhead ({engine} engine, gateway HTTP vs engine gRPC; load average "
          f"{' '.join(f'{x:.1f}' for x in r['load_before'])} -> {' '.join(f'{x:.1f}' for x in r['load_after'])})\n"
          f"TTFT p50: gRPC {r['grpc']['ttft_p50_ms']:.2f} ms, gateway gRPC {r['gateway_grpc']['ttft_p50_ms']:.2f} ms, "
          f"HTTP {r['http']['ttft_p50_ms']:.2f} ms, added {r['ttft_p50_added_ms']:+.2f} ms (goal <= +1 ms; the hop "
          f"alone {r['hop_p50_added_ms']:+.2f} ms)\n"
          f"TTFT p99: gRPC {r['grpc']['ttft_p99_ms']:.2f} ms, gateway gRPC {r['gateway_grpc']['ttft_p99_ms']:.2f} ms, "
          f"HTTP {r['http']['ttft_p99_ms']:.2f} ms, added {r['ttft_p99_added_ms']:+.2f} ms\n"
          f"32 streams: gRPC {r['grpc']['tokens_per_s']:.0f} tok/s, HTTP {r['http']['tokens_per_s']:.0f} tok/s, "
          f"ratio {r['tokens_per_s_ratio']:.2f}x (goal >= 0.95x); per token: gateway CPU "
          f"{r['gateway_cpu_us_per_token']:.0f} us, engine CPU {r['engine_cpu_us_per_token']:.0f} us (CPU-bound ratio "
          f"{r['cpu_bound_ratio'] or float('nan'):.2f}x)\n"
          f"rounds, tokens/s: gRPC {[round(x) for x in r['grpc']['tokens_per_s_rounds']]}, HTTP "
          f"{[round(x) for x in r['http']['tokens_per_s_rounds']]}", flush=True)
    return r


def _row(name: str, r) -> str:
    tight, loose = r.attained.get("tight", (0, 1)), r.attained.get("loose", (0, 1))
    share = "/".join(f"{100 * r.share.get(k, 0):.0f}" for k in ("fast", "medium", "slow", "weak"))
    return (f"| {name} | {100 * r.attainment:.1f} % | {100 * tight[0] / tight[1]:.0f} % | "
            f"{100 * loose[0] / loose[1]:.0f} % | {1000 * r.cost_per_request:.1f} | {r.e2e_p50_ms:.0f} | "
            f"{r.e2e_p99_ms:.0f} | {r.free_p50_ms:.0f} | {share} |" + (f" ({r.failed} failed)" if r.failed else ""))


def _runs(name: str, traces: list, stop_below: float | None = None) -> list | str:
    """Results of the policy or real peer ``name`` over the traces, or why the peer was skipped."""
    if name in policies.POLICIES:
        return policies.run_policy_traces(name, traces, stop_below)
    return peers.run_peer(name, traces, stop_below)


def _policies(quick: bool, rate: float, seconds: float, with_peers: bool) -> dict:
    jobs = poisson_trace(rate, seconds / (2 if quick else 1), seed=1)
    names = [*policies.POLICIES, *(peers.PEERS if with_peers else ())]
    print(f"\n## Routing policies and real peers ({len(jobs)} requests, Poisson {rate:g}/s; SLA: tight 1.6x / loose "
          f"4x an idle fast engine, or none; LiteLLM {peers.LITELLM_VERSION}, Portkey {peers.PORTKEY_VERSION})\n"
          "| policy | SLA met | tight | loose | cost / request | e2e p50 ms | e2e p99 ms | SLA-free e2e p50 ms "
          "| fast/medium/slow/weak |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    out, skipped = {}, {}
    for name in names:
        runs = _runs(name, [jobs])
        if isinstance(runs, str):
            skipped[name] = runs
            print(f"| {name} | skipped: {runs} |", flush=True)
            continue
        r = runs[0]
        print(_row(name, r), flush=True)
        out[name] = {"attainment": r.attainment, "attained": r.attained, "cost_per_request": r.cost_per_request,
                     "e2e_p50_ms": r.e2e_p50_ms, "e2e_p99_ms": r.e2e_p99_ms, "free_p50_ms": r.free_p50_ms,
                     "share": r.share, "failed": r.failed, "estimate_error_p50": r.estimate_error_p50}
    ours = out["tokenmill-latency"]
    baselines = {k: v for k, v in out.items() if k in policies.POLICIES and k != "tokenmill-latency"}
    for label, group in (("reimplemented baseline", baselines), ("real peer", {k: v for k, v in out.items()
                                                                                if k not in policies.POLICIES})):
        if not group:
            continue
        best_name = max(group, key=lambda k: group[k]["attainment"])
        best = group[best_name]
        free = min(v["free_p50_ms"] for v in group.values())
        print(f"tokenmill-latency against the best {label} ({best_name}): "
              f"{100 * (ours['attainment'] - best['attainment']):+.1f} points of SLA attainment (goal >= +10) at "
              f"{ours['cost_per_request'] / best['cost_per_request']:.2f}x its cost; SLA-free e2e p50 "
              f"{ours['free_p50_ms']:.0f} ms, {ours['free_p50_ms'] / free:.2f}x the best {label}'s {free:.0f} ms "
              f"(goal <= 2x)", flush=True)
    print(f"median estimate error {100 * (ours['estimate_error_p50'] or float('nan')):.1f} % (goal <= 15 %)")
    return {**out, "skipped": skipped}


def _goodput(quick: bool, rates: tuple[float, ...], seconds: float, warmup_s: float, with_peers: bool) -> dict:
    seconds = seconds / (2 if quick else 1)
    traces = [poisson_trace(rate, seconds, seed=2, warmup_s=warmup_s) for rate in rates]
    names = [*policies.POLICIES, *(peers.PEERS if with_peers else ())]
    print(f"\n## Goodput: the highest arrival rate (of {', '.join(f'{r:g}' for r in rates)}/s, {seconds:g} s "
          f"traces after {warmup_s:g} s of warm-up) at which >= {100 * policies.GOODPUT_SLA_MET:.0f} % of SLA requests meet "
          "their SLA\n"
          "| policy | goodput req/s | SLA met at each rate tried |\n| --- | --- | --- |", flush=True)
    out, skipped = {}, {}
    for name in names:
        runs = _runs(name, traces, stop_below=policies.GOODPUT_SLA_MET)
        if isinstance(runs, str):
            skipped[name] = runs
            print(f"| {name} | skipped: {runs} |", flush=True)
            continue
        value = policies.goodput(runs, list(rates))
        out[name] = {"goodput": value, "attainment": {str(rate): r.attainment for rate, r in zip(rates, runs)}}
        print(f"| {name} | {value:g} | " + ", ".join(f"{rate:g}/s {100 * r.attainment:.0f} %"
                                                    for rate, r in zip(rates, runs)) + " |", flush=True)
    ours = out["tokenmill-latency"]["goodput"]
    for label, group in (("reimplemented baseline", [k for k in out if k in policies.POLICIES
                                                      and k != "tokenmill-latency"]),
                         ("real peer", [k for k in out if k not in policies.POLICIES])):
        if group:
            best = max(group, key=lambda k: out[k]["goodput"])
            ratio = f"{ours / out[best]['goodput']:.2f}x" if out[best]["goodput"] else "n/a against"
            print(f"tokenmill-latency goodput {ours:g} req/s, {ratio} the best {label}'s ({best}, "
                  f"{out[best]['goodput']:g} req/s; goal >= 1.5x)", flush=True)
    return {**out, "skipped": skipped}


def _decision() -> dict:
    r = decision.measure()
    print("\n## One routing decision, 64 targets (20,000 requests)\n"
          "| strategy | CPU p50 us | CPU p99 us | wall p50 us | wall p99 us |\n| --- | --- | --- | --- | --- |")
    for name, v in r.items():
        print(f"| {name} | {v['cpu_p50_us']:.1f} | {v['cpu_p99_us']:.1f} | {v['wall_p50_us']:.1f} | "
              f"{v['wall_p99_us']:.1f} |")
    print(f"latency p99: {r['latency']['cpu_p99_us']:.0f} us of CPU (goal <= 200 us)", flush=True)
    return r


def _throughput(quick: bool) -> dict:
    r = throughput.measure(seconds=4 if quick else 8)
    print("\n## Routed requests/s, one gateway process on one core, 8 simulated targets\n"
          "| front end | requests/s | gateway CPU (cores) | requests per gateway CPU-second | gateway CPU us / request "
          "| simulator CPU us / request |\n| --- | --- | --- | --- | --- | --- |")
    for front, v in r.items():
        print(f"| {front} | {v['requests_per_s']:.0f} | {v['gateway_cpu_share']:.2f} | "
              f"{v['requests_per_gateway_cpu_s']:.0f} | {v['gateway_cpu_us_per_request']:.0f} | "
              f"{v['simulator_cpu_us_per_request']:.0f} |")
    print("goal: >= 2,000 routed requests/s on one core", flush=True)
    return r


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = flags.parse(GatewaySettings, argv, prog=prog, description=__doc__)
    parts = list(args.parts)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    configure_logging("bench-gateway", "warning")  # the pools' target_joined lines are not the report
    began = time.time()
    report = {"command": harness_report.command_line(prog, argv), "commit": harness_report.git_revision()["short"],
              "load_before": _load(), "cpus": os.cpu_count()}
    print(f"# make bench-gateway at {report['commit']}, load average {report['load_before']}, "
          f"{report['cpus']} CPUs", flush=True)
    runners = {"overhead": lambda: _overhead(args.quick, args.start_timeout, args.overhead_engine), "policies": lambda: _policies(args.quick, args.rate,
                                                                                           args.seconds, args.peers),
               "goodput": lambda: _goodput(args.quick, args.goodput_rates, args.goodput_seconds,
                                                 args.goodput_warmup_s, args.peers),
               "decision": _decision, "throughput": lambda: _throughput(args.quick)}
    for part in parts:
        report[part] = runners[part]()
    report["load_after"] = _load()
    report["seconds"] = time.time() - began
    print(f"\nload average after: {report['load_after']}; {report['seconds']:.0f} s")
    out = harness_report.write_result(report, harness_report.result_path("gateway", args.out))
    print(f"wrote {out}")
    return 0
