"""``make bench-gateway``: the gateway's four questions, answered in one run with ratios.

    python -m benchmarks.gateway [--parts overhead,policies,decision,throughput] [--quick]

1. overhead    HTTP through the gateway against the engine's gRPC API directly (stories260K):
               TTFT p50 added, 32-stream tokens/s ratio, the gateway's CPU per token.
2. policies    five routing policies on one simulated heterogeneous pool, one Poisson trace:
               SLA attainment, cost, response times, the estimate's error.
3. decision    one routing decision with 64 targets: p50/p99, wall and CPU time.
4. throughput  routed requests/s of one gateway process on one core against simulated targets.

Prints the report (with the command, commit and load average, which the figures depend on)
and writes it as JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gateway import decision, overhead, policies, throughput
from benchmarks.gateway.processes import REPO_ROOT
from benchmarks.gateway.workload import poisson_trace
from services.common.logging import configure_logging

PARTS = ("overhead", "policies", "decision", "throughput")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _load() -> str:
    path = Path("/proc/loadavg")
    return " ".join(path.read_text().split()[:3]) if path.exists() else "?"


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
          "| policy | SLA met | tight | loose | cost / request | e2e p50 ms | e2e p99 ms | fast/medium/slow/weak |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    out = {}
    for name in policies.POLICIES:
        r = asyncio.run(policies.run_policy(name, jobs))
        tight, loose = r.attained.get("tight", (0, 1)), r.attained.get("loose", (0, 1))
        share = "/".join(f"{100 * r.share.get(k, 0):.0f}" for k in ("fast", "medium", "slow", "weak"))
        print(f"| {name} | {100 * r.attainment:.1f} % | {100 * tight[0] / tight[1]:.0f} % | "
              f"{100 * loose[0] / loose[1]:.0f} % | {1000 * r.cost_per_request:.1f} | {r.e2e_p50_ms:.0f} | "
              f"{r.e2e_p99_ms:.0f} | {share} |" + (f" ({r.failed} failed)" if r.failed else ""), flush=True)
        out[name] = {"attainment": r.attainment, "attained": r.attained, "cost_per_request": r.cost_per_request,
                     "e2e_p50_ms": r.e2e_p50_ms, "e2e_p99_ms": r.e2e_p99_ms, "share": r.share, "failed": r.failed,
                     "estimate_error_p50": r.estimate_error_p50}
    ours = out["tokenmill-latency"]
    best = max((v for k, v in out.items() if k != "tokenmill-latency"), key=lambda v: v["attainment"])
    best_name = next(k for k, v in out.items() if v is best)
    print(f"tokenmill-latency: {100 * (ours['attainment'] - best['attainment']):+.1f} points of SLA attainment over "
          f"the best baseline ({best_name}) at {ours['cost_per_request'] / best['cost_per_request']:.2f}x its cost "
          f"(goal: >= +10 points at <= 1x); median estimate error "
          f"{100 * (ours['estimate_error_p50'] or float('nan')):.1f} % (goal <= 15 %)", flush=True)
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


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.gateway") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test, not figures)")
    parser.add_argument("--rate", type=float, default=16.0, help="requests/s of the routing workload")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the routing workload's trace")
    parser.add_argument("--out", default=".tokenmill/bench-gateway.json", help="where the JSON report goes")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    configure_logging("bench-gateway", "warning")  # the pools' target_joined lines are not the report
    began = time.time()
    report = {"command": " ".join([prog, *(argv if argv is not None else sys.argv[1:])]), "commit": _commit(),
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    return 0
