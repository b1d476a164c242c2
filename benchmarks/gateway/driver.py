"""``make bench-gateway``: the gateway's four questions, answered in one run with ratios.

    python -m benchmarks gateway [--parts overhead,policies,decision,throughput] [--quick]

1. overhead    HTTP through the gateway against the engine's gRPC API directly (stories260K):
               TTFT p50 added, 32-stream tokens/s ratio, the gateway's CPU per token.
2. policies    five routing policies on one simulated heterogeneous pool, one Poisson trace:
               SLA attainment, cost, response times, the estimate's error.
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

from benchmarks.gateway import decision, overhead, policies, throughput
from benchmarks.gateway.workload import poisson_trace
from benchmarks.harness import flags, report as harness_report
from benchmarks.harness.flags import setting
from services.common.logging import configure_logging

PROG = "python -m benchmarks gateway"
PARTS = ("overhead", "policies", "decision", "throughput")


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    parts: tuple[str, ...] = setting(PARTS, f"comma-separated subset of {', '.join(PARTS)}")
    quick: bool = setting(False, "shorter runs (a smoke test, not figures)")
    rate: float = setting(16.0, "requests/s of the routing workload")
    seconds: float = setting(30.0, "length of the routing workload's trace")
    out: str | None = setting(None, "where the JSON report goes (none: benchmarks/results/gateway-DATE.json)")

    def validate(self) -> None:
        flags.check_choices("parts", self.parts, PARTS)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def _overhead(quick: bool) -> dict:
    r = overhead.measure(rounds=2 if quick else 4, ttft_requests=10 if quick else 20)
    print(f"\n## HTTP overhead (stories260K, gateway HTTP vs engine gRPC)\n"
          f"TTFT p50: gRPC {r['grpc']['ttft_p50_ms']:.2f} ms, HTTP {r['http']['ttft_p50_ms']:.2f} ms, "
          f"added {r['ttft_p50_added_ms']:+.2f} ms (goal <= +1 ms)\n"
          f"32 streams: gRPC {r['grpc']['tokens_per_s']:.0f} tok/s, HTTP {r['http']['tokens_per_s']:.0f} tok/s, "
          f"ratio {r['tokens_per_s_ratio']:.2f}x (goal >= 0.95x); per token: gateway CPU "
          f"{r['gateway_cpu_us_per_token']:.0f} us, engine CPU {r['engine_cpu_us_per_token']:.0f} us (CPU-bound ratio "
          f"{r['cpu_bound_ratio'] or float('nan'):.2f}x)\n"
          f"rounds, tokens/s: gRPC {[round(x) for x in r['grpc']['tokens_per_s_rounds']]}, HTTP "
          f"{[round(x) for x in r['http']['tokens_per_s_rounds']]}", flush=True)
    return r


def _policies(quick: bool, rate: float, seconds: float) -> dict:
    jobs = poisson_trace(rate, seconds / (2 if quick else 1), seed=1)
    print(f"\n## Routing policies ({len(jobs)} requests, Poisson {rate:g}/s; SLA: tight 1.6x / loose 4x an idle fast "
          "engine, or none)\n"
          "| policy | SLA met | tight | loose | cost / request | e2e p50 ms | e2e p99 ms | SLA-free e2e p50 ms "
          "| fast/medium/slow/weak |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    out = {}
    for name in policies.POLICIES:
        r = asyncio.run(policies.run_policy(name, jobs))
        tight, loose = r.attained.get("tight", (0, 1)), r.attained.get("loose", (0, 1))
        share = "/".join(f"{100 * r.share.get(k, 0):.0f}" for k in ("fast", "medium", "slow", "weak"))
        print(f"| {name} | {100 * r.attainment:.1f} % | {100 * tight[0] / tight[1]:.0f} % | "
              f"{100 * loose[0] / loose[1]:.0f} % | {1000 * r.cost_per_request:.1f} | {r.e2e_p50_ms:.0f} | "
              f"{r.e2e_p99_ms:.0f} | {r.free_p50_ms:.0f} | {share} |" + (f" ({r.failed} failed)" if r.failed else ""), flush=True)
        out[name] = {"attainment": r.attainment, "attained": r.attained, "cost_per_request": r.cost_per_request,
                     "e2e_p50_ms": r.e2e_p50_ms, "e2e_p99_ms": r.e2e_p99_ms, "free_p50_ms": r.free_p50_ms, "share": r.share, "failed": r.failed,
                     "estimate_error_p50": r.estimate_error_p50}
    ours = out["tokenmill-latency"]
    best = max((v for k, v in out.items() if k != "tokenmill-latency"), key=lambda v: v["attainment"])
    best_name = next(k for k, v in out.items() if v is best)
    print(f"tokenmill-latency: {100 * (ours['attainment'] - best['attainment']):+.1f} points of SLA attainment over "
          f"the best baseline ({best_name}) at {ours['cost_per_request'] / best['cost_per_request']:.2f}x its cost "
          f"(goal: >= +10 points at <= 1x); median estimate error "
          f"{100 * (ours['estimate_error_p50'] or float('nan')):.1f} % (goal <= 15 %); SLA-free e2e p50 "
          f"{ours['free_p50_ms']:.0f} ms against the best baseline's "
          f"{min(v['free_p50_ms'] for k, v in out.items() if k != 'tokenmill-latency'):.0f} ms (goal <= 2x)",
          flush=True)
    return out


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
    runners = {"overhead": lambda: _overhead(args.quick), "policies": lambda: _policies(args.quick, args.rate,
                                                                                           args.seconds),
               "decision": _decision, "throughput": lambda: _throughput(args.quick)}
    for part in parts:
        report[part] = runners[part]()
    report["load_after"] = _load()
    report["seconds"] = time.time() - began
    print(f"\nload average after: {report['load_after']}; {report['seconds']:.0f} s")
    out = harness_report.write_result(report, harness_report.result_path("gateway", args.out))
    print(f"wrote {out}")
    return 0
