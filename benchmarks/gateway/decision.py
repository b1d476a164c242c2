"""How long one routing decision takes with 64 targets: ``rank`` of each strategy, timed alone.

The targets carry live-looking state (profiles, fits from 40 observations each at random loads,
requests in flight); each request has its own output length, SLA and prompt. Each call is timed
twice: wall time (time.perf_counter_ns) and the thread's CPU time (time.thread_time_ns). On a
machine shared with other work the wall-time tail is the OS's time slices (a preempted call
waits milliseconds); the CPU time is what the decision itself costs.
"""

from __future__ import annotations

import random
import time

from services.gateway.routes_file import ModelSpec
from services.gateway.routing.build import build_route
from services.gateway.routing.profile import ProfileView
from services.gateway.routing.request import RouteRequest
from services.gateway.routing.target import TargetState

STRATEGIES = {
    "latency": lambda names: {"strategy": "latency", "targets": names},
    "prefix-affinity": lambda names: {"strategy": "prefix-affinity", "targets": names},
    "loadbalance": lambda names: {"strategy": "loadbalance", "targets": names},
    "fallback(loadbalance x2)": lambda names: {"strategy": "fallback", "targets": [
        {"strategy": "loadbalance", "targets": names[: len(names) // 2]},
        {"strategy": "loadbalance", "targets": names[len(names) // 2:]}]},
}


def _pool(n: int, rng: random.Random) -> dict[str, TargetState]:
    targets = {}
    for i in range(n):
        t = TargetState(f"t{i}", cost=rng.choice((0.1, 0.3, 0.5, 1.0)), healthy=True)
        ttft, tpot = rng.uniform(20, 200), rng.uniform(5, 40)
        t.set_profile(ProfileView(0.0, 50, ttft, 2 * ttft, tpot, 2 * tpot, 1000 / tpot, 0.3, rng.randint(0, 12),
                                  rng.randint(0, 3)))
        for _ in range(40):
            load = rng.randint(0, 16)
            tokens = rng.randint(2, 256)
            e2e = ttft * (1 + 0.05 * load) + (tokens - 1) * tpot * (1 + 0.04 * load)
            t.estimator.observe(load, ttft * (1 + 0.05 * load), tokens, e2e, now=0.0, raw_estimate_ms=e2e * 0.95)
        t.inflight = rng.randint(0, 8)
        targets[t.name] = t
    return targets


def measure(targets: int = 64, requests: int = 20_000, seed: int = 3) -> dict[str, dict[str, float]]:
    """{strategy: {p50_us, p99_us, max_us}}."""
    rng = random.Random(seed)
    pool = _pool(targets, rng)
    names = list(pool)
    reqs = [RouteRequest("m", rng.choice((16, 64, 256)), rng.choice((None, 500.0, 2000.0, 8000.0)),
                         rng.random() < 0.1, f"System prompt {rng.randint(0, 20)}. " * 10 + str(i))
            for i in range(requests)]
    out = {}
    for name, spec in STRATEGIES.items():
        node = build_route(ModelSpec("m", spec(names)), pool, rng=random.Random(seed), clock=lambda: 1.0).node
        wall, cpu = [], []
        for r in reqs[:500]:  # warm caches
            node.rank(r)
        for r in reqs:
            began, began_cpu = time.perf_counter_ns(), time.thread_time_ns()
            node.rank(r)
            cpu.append(time.thread_time_ns() - began_cpu)
            wall.append(time.perf_counter_ns() - began)
        wall.sort()
        cpu.sort()
        out[name] = {"wall_p50_us": wall[len(wall) // 2] / 1000, "wall_p99_us": wall[int(0.99 * len(wall))] / 1000,
                     "cpu_p50_us": cpu[len(cpu) // 2] / 1000, "cpu_p99_us": cpu[int(0.99 * len(cpu))] / 1000}
    return out
