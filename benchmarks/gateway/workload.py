"""The routing benchmark's pool and workload: a heterogeneous simulated pool, Poisson arrivals.

The pool: three speeds of the same model and a cheap "weak" one (an INT4 build: fast when idle,
but its small batch saturates quickly), two engines of each:

    class   prefill  TPOT   slowdown/req  max batch  cost / 1k tokens
    fast     20 ms   8 ms      0.05          16          1.00
    medium   40 ms  16 ms      0.05          16          0.50
    slow     80 ms  30 ms      0.04          16          0.30
    weak     15 ms  10 ms      0.25           8          0.10

Requests arrive as a Poisson process; each asks for 16-256 tokens and carries an SLA relative
to what an idle fast engine would take (prefill + tokens x TPOT): 40 % tight (1.6x), 30 % loose
(4x), 30 % none. Prompts come from 8 shared system prompts (so prefix-cache-aware routing has
something to find). One seed fixes the whole trace: every policy gets the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

POOL = {
    "fast": dict(prefill_ms=20.0, tpot_ms=8.0, batch_slowdown=0.05, max_running=16),
    "medium": dict(prefill_ms=40.0, tpot_ms=16.0, batch_slowdown=0.05, max_running=16),
    "slow": dict(prefill_ms=80.0, tpot_ms=30.0, batch_slowdown=0.04, max_running=16),
    "weak": dict(prefill_ms=15.0, tpot_ms=10.0, batch_slowdown=0.25, max_running=8),
}
COSTS = {"fast": 1.0, "medium": 0.5, "slow": 0.3, "weak": 0.1}
REPLICAS = 2
STREAM_INTERVAL = 8
OUTPUT_TOKENS = (16, 32, 64, 128, 256)
OUTPUT_WEIGHTS = (0.2, 0.3, 0.25, 0.15, 0.1)
SLA_CLASSES = (("tight", 1.6, 0.4), ("loose", 4.0, 0.3), ("none", None, 0.3))
SYSTEM_PROMPTS = [f"You are assistant number {i}. Answer politely, briefly and precisely. " * 4 for i in range(8)]


@dataclass(frozen=True, slots=True)
class Job:
    at_s: float
    prompt: str
    max_tokens: int
    sla_ms: float | None
    sla_class: str
    counted: bool = True
    """False for a warm-up request: sent like the others, left out of the figures."""


def sim_engines(jitter: float = 0.05) -> list[dict]:
    """The simulator's --engines list: REPLICAS of each class, named class-0, class-1."""
    return [{"name": name, **spec, "count": REPLICAS, "jitter": jitter, "stream_interval": STREAM_INTERVAL,
             "seed": 11 * index} for index, (name, spec) in enumerate(POOL.items())]


def engine_names() -> list[str]:
    return [f"{name}-{k}" for name in POOL for k in range(REPLICAS)]


def cost_of(target: str) -> float:
    return COSTS[target.rsplit("-", 1)[0]]


def poisson_trace(rate_per_s: float, duration_s: float, seed: int = 1, warmup_s: float = 0.0) -> list[Job]:
    """``duration_s`` of arrivals after ``warmup_s`` of warm-up ones (sent, not counted): the
    routers learn their targets' latencies first, and the figures are of the steady state."""
    duration_s += warmup_s
    rng = random.Random(seed)
    fast = POOL["fast"]
    jobs, t = [], 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            return jobs
        tokens = rng.choices(OUTPUT_TOKENS, OUTPUT_WEIGHTS)[0]
        name, slack, _ = rng.choices(SLA_CLASSES, [w for _, _, w in SLA_CLASSES])[0]
        idle_fast_ms = fast["prefill_ms"] + fast["tpot_ms"] * tokens
        prompt = rng.choice(SYSTEM_PROMPTS) + f"Question {len(jobs)}: what happens next?"
        jobs.append(Job(t, prompt, tokens, None if slack is None else slack * idle_fast_ms, name, t >= warmup_s))
