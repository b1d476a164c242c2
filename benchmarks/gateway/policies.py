"""Routing policies compared on one simulated heterogeneous pool and one Poisson trace.

Each policy gets a fresh simulator (fresh engines and profiles) and a fresh target pool, and the
same requests at the same times. Requests go through the gateway's Dispatcher (in this process)
to the simulated engines over gRPC, so every policy pays the same routing and transport costs.
Reported per policy: SLA attainment (requests with an SLA whose response time, as the client saw
it, was within it), cost per request (tokens x the target's cost), response-time percentiles, and
for tokenmill the error of its response-time estimate.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

from benchmarks.gateway import baselines
from benchmarks.gateway.processes import simulator
from benchmarks.gateway.workload import Job, cost_of, engine_names, sim_engines
from services.common.pb.tokenmill.v1 import generation_pb2
from services.gateway.dispatch import Dispatcher, Outcome
from services.gateway.pool import TargetPool
from services.gateway.routes_file import TargetSpec
from services.gateway.routing.build import RETRY_ALWAYS, Route
from services.gateway.routing.latency import LatencyRouted
from services.gateway.routing.request import RouteRequest

POLICIES = {
    "round-robin": baselines.RoundRobin,
    "portkey-least-latency": baselines.PortkeyLeastLatency,
    "litellm-latency-per-token": baselines.LiteLLMLatency,
    "sglang-cache-aware": baselines.SGLangCacheAware,
    "tokenmill-latency": LatencyRouted,
}


@dataclass
class PolicyResult:
    policy: str
    requests: int = 0
    failed: int = 0
    attained: dict[str, tuple[int, int]] = field(default_factory=dict)
    cost_per_request: float = 0.0
    e2e_p50_ms: float = 0.0
    e2e_p99_ms: float = 0.0
    free_p50_ms: float = 0.0
    """Median response time of the SLA-free requests (where cheap routing can pile them up)."""
    share: dict[str, float] = field(default_factory=dict)
    estimate_error_p50: float | None = None
    rows: list[tuple[str, str, float, float | None, float | None]] = field(default_factory=list, repr=False)
    """(SLA class, target, observed ms, SLA ms, estimate ms) of each request, for diagnosis."""

    @property
    def attainment(self) -> float:
        hit = sum(h for h, _ in self.attained.values())
        total = sum(n for _, n in self.attained.values())
        return hit / total if total else 0.0


async def _one(dispatcher: Dispatcher, route: Route, job: Job, index: int, t0: float, records: dict) -> None:
    await asyncio.sleep(max(0.0, t0 + job.at_s - time.monotonic()))
    request = generation_pb2.GenerateRequest(text=job.prompt, request_id=f"job-{index}")
    request.stop.max_tokens = job.max_tokens
    rr = RouteRequest(route.model, job.max_tokens, job.sla_ms, False, job.prompt)
    began = time.monotonic()
    try:
        async for _ in dispatcher.generate(route, rr, request, (), 120.0):
            pass
        records[request.request_id] = (time.monotonic() - began) * 1000.0
    except Exception:  # noqa: BLE001 - a failed request counts against the policy
        records[request.request_id] = None


def _summary(policy: str, jobs: list[Job], records: dict, outcomes: dict[str, Outcome]) -> PolicyResult:
    result = PolicyResult(policy, requests=sum(job.counted for job in jobs))
    times, free, cost, share = [], [], 0.0, Counter()
    attained: dict[str, list[int]] = {}
    errors = []
    for index, job in enumerate(jobs):
        if not job.counted:
            continue
        rid = f"job-{index}"
        e2e, outcome = records.get(rid), outcomes.get(rid)
        if e2e is None or outcome is None:
            result.failed += 1
            continue
        times.append(e2e)
        result.rows.append((job.sla_class, outcome.target, e2e, job.sla_ms, outcome.estimate_ms))
        cost += cost_of(outcome.target) * outcome.completion_tokens / 1000.0
        share[outcome.target.rsplit("-", 1)[0]] += 1
        if job.sla_ms is None:
            free.append(e2e)
        else:
            hit_total = attained.setdefault(job.sla_class, [0, 0])
            hit_total[0] += e2e <= job.sla_ms
            hit_total[1] += 1
        if outcome.estimate_ms and not outcome.explore:
            errors.append(abs(outcome.observed_ms - outcome.estimate_ms) / outcome.observed_ms)
    times.sort()
    result.attained = {k: (v[0], v[1]) for k, v in attained.items()}
    result.cost_per_request = cost / max(len(times), 1)
    result.e2e_p50_ms = statistics.median(times) if times else 0.0
    result.free_p50_ms = statistics.median(free) if free else 0.0
    result.e2e_p99_ms = times[min(len(times) - 1, int(0.99 * len(times)))] if times else 0.0
    result.share = {k: v / max(len(times), 1) for k, v in sorted(share.items())}
    if policy == "tokenmill-latency" and errors:
        result.estimate_error_p50 = statistics.median(errors)
    return result


def summarize(policy: str, jobs: list[Job], records: dict[int, tuple[float, str, int] | None]) -> PolicyResult:
    """A peer's run as the dispatcher's would be summed up: ``records`` holds each request's (e2e
    ms, engine that served it, completion tokens), or None when it failed."""
    e2e, outcomes = {}, {}
    for index, job in enumerate(jobs):
        rid, record = f"job-{index}", records.get(index)
        e2e[rid] = None if record is None else record[0]
        if record is not None:
            outcomes[rid] = Outcome("m", record[1], rid, None, None, record[0], 0.0, record[2], job.sla_ms, False)
    return _summary(policy, jobs, e2e, outcomes)


GOODPUT_SLA_MET = 0.9
"""DistServe's goodput: the highest arrival rate at which this share of SLA requests meet theirs."""


def goodput(results: list[PolicyResult], rates: list[float]) -> float:
    """The highest of ``rates`` (ascending, one result each, possibly cut short at the first miss)
    below which every rate met GOODPUT_SLA_MET; 0 when the lowest did not."""
    best = 0.0
    for rate, result in zip(rates, results):
        if result.attainment < GOODPUT_SLA_MET:
            break
        best = rate
    return best


def run_policy_traces(policy: str, traces: list[list[Job]], stop_below: float | None = None) -> list[PolicyResult]:
    """``policy`` (one of POLICIES) over each trace on a fresh pool, until one's attainment is below
    ``stop_below``."""
    results = []
    for jobs in traces:
        results.append(asyncio.run(run_policy(policy, jobs)))
        if stop_below is not None and results[-1].attainment < stop_below:
            break
    return results


async def run_policy(policy: str, jobs: list[Job]) -> PolicyResult:
    with simulator(sim_engines()) as (addresses, _):
        specs = tuple(TargetSpec(name, addresses[name], cost=cost_of(name)) for name in engine_names())
        pool = TargetPool(specs, interval_s=0.25, window_s=10.0)
        await pool.start(wait_s=3.0)
        states = [pool.states[name] for name in engine_names()]
        node = POLICIES[policy](states)
        route = Route("m", node, None, False, 128, RETRY_ALWAYS, "")
        dispatcher = Dispatcher({"m": route}, pool, default_model="m")
        outcomes: dict[str, Outcome] = {}
        dispatcher.observers.append(lambda o: outcomes.__setitem__(o.request_id, o))
        if hasattr(node, "observe"):
            dispatcher.observers.append(node.observe)
        records: dict = {}
        t0 = time.monotonic() + 0.2
        await asyncio.gather(*(_one(dispatcher, route, job, i, t0, records) for i, job in enumerate(jobs)))
        await pool.close()
    return _summary(policy, jobs, records, outcomes)
