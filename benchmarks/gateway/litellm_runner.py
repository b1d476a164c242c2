"""LiteLLM's Router over the simulated pool's HTTP APIs, run by peers.py in LiteLLM's own virtual
environment (so it imports nothing of tokenmill's):

    python litellm_runner.py SPEC.json OUT.json

SPEC holds the routing strategy, the deployments ({engine name: api base}) and the traces (lists of
[arrival s, prompt, max_tokens, SLA ms or null]). Each trace goes through a fresh Router (no latency history carried
over), each job sent at its time with ``acompletion``, until a trace's SLA attainment is below
``stop_below`` (when given); OUT receives, per trace, {index: [e2e ms,
engine that served it, completion tokens] or null}.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import litellm
from litellm import Router


def router(strategy: str, deployments: dict[str, str]) -> Router:
    model_list = [{"model_name": "m", "litellm_params": {"model": f"openai/{name}", "api_base": base,
                                                         "api_key": "simulated", "timeout": 120},
                   "model_info": {"id": name}} for name, base in deployments.items()]
    return Router(model_list=model_list, routing_strategy=strategy, num_retries=0, allowed_fails=1000,
                  cooldown_time=0)


async def run_trace(strategy: str, deployments: dict[str, str], jobs: list) -> dict:
    r = router(strategy, deployments)
    records: dict = {}
    t0 = time.monotonic() + 0.2

    async def one(index: int, at_s: float, prompt: str, max_tokens: int, sla_ms: float | None) -> None:
        await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
        began = time.monotonic()
        try:
            response = await r.acompletion(model="m", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens)
            served = (getattr(response, "_hidden_params", None) or {}).get("model_id") or response.model
            records[index] = [(time.monotonic() - began) * 1000.0, served, response.usage.completion_tokens]
        except Exception:  # noqa: BLE001 - a failed request counts against the router
            records[index] = None

    await asyncio.gather(*(one(i, *job) for i, job in enumerate(jobs)))
    return records


async def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    litellm.suppress_debug_info = True
    litellm.telemetry = False
    out = []
    for jobs in spec["traces"]:
        records = await run_trace(spec["strategy"], spec["deployments"], jobs)
        out.append(records)
        with_sla = [(i, job[3]) for i, job in enumerate(jobs) if job[3] is not None]
        met = sum(1 for i, sla in with_sla if records.get(i) is not None and records[i][0] <= sla)
        if spec.get("stop_below") is not None and with_sla and met / len(with_sla) < spec["stop_below"]:
            break
        await asyncio.sleep(1.0)  # the pool drains between traces
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    asyncio.run(main())
