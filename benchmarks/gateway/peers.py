"""The real peers of the routing benchmark: LiteLLM's Router and Portkey's gateway, installed from
their registries at pinned versions into a cache this benchmark creates, run on the same simulated
pool (its OpenAI-compatible HTTP API, simulator/http_api.py) and the same Poisson trace.

- LiteLLM (PyPI ``litellm``) runs in its own virtual environment under the cache, in a process of
  its own (litellm_runner.py): its Router, in-process as tokenmill's dispatcher is in the policies
  part, sends each job at its time with ``acompletion`` and reports what it saw.
- Portkey (npm ``@portkey-ai/gateway``) runs as its node server; this process sends each job at its
  time with its ``x-portkey-config``: ``loadbalance`` over the engines with equal weights, and with
  weights proportional to each engine's capacity (its tokens/s at a full batch).

A peer whose install fails is skipped with the reason printed; nothing else skips it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx2

from benchmarks.gateway.policies import PolicyResult, summarize
from benchmarks.gateway.processes import _stop, _wait_file
from benchmarks.gateway.workload import POOL, Job, engine_names, sim_engines
from benchmarks.harness.paths import REPO_ROOT

LITELLM_VERSION = "1.110.2"
PORTKEY_VERSION = "1.15.2"
LITELLM_STRATEGIES = ("simple-shuffle", "least-busy", "latency-based-routing", "usage-based-routing-v2")
PORTKEY_WEIGHTS = ("equal", "capacity")
RUNNER = Path(__file__).with_name("litellm_runner.py")
CACHE = Path(os.environ.get("TOKENMILL_BENCH_CACHE", Path.home() / ".cache" / "tokenmill" / "bench-peers"))
"""Where the peers are installed (``TOKENMILL_BENCH_CACHE``); made on first use."""


def install_litellm() -> tuple[Path | None, str]:
    """(the venv's python, "") once litellm==LITELLM_VERSION imports there; (None, why) otherwise."""
    venv = CACHE / f"litellm-{LITELLM_VERSION}"
    python = venv / "bin" / "python"
    check = [str(python), "-c", f"import importlib.metadata as m; assert m.version('litellm') == '{LITELLM_VERSION}'"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python, ""
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True,
                       timeout=300)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"litellm=={LITELLM_VERSION}"], check=True,
                       capture_output=True, timeout=1200)
        subprocess.run(check, check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return None, f"pip install litellm=={LITELLM_VERSION} failed: {exc} {detail.decode(errors='replace')[-400:]}"
    return python, ""


def install_portkey() -> tuple[Path | None, str]:
    """(its start-server.js, "") once @portkey-ai/gateway@PORTKEY_VERSION is in the cache; (None, why)."""
    prefix = CACHE / f"portkey-{PORTKEY_VERSION}"
    server = prefix / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"
    package = server.parent.parent / "package.json"
    if server.exists() and json.loads(package.read_text()).get("version") == PORTKEY_VERSION:
        return server, ""
    try:
        subprocess.run(["npm", "install", "--prefix", str(prefix), f"@portkey-ai/gateway@{PORTKEY_VERSION}",
                        "--no-audit", "--no-fund", "--ignore-scripts"], check=True, capture_output=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return None, f"npm install @portkey-ai/gateway@{PORTKEY_VERSION} failed: {exc} " \
                     f"{detail.decode(errors='replace')[-400:]}"
    if not server.exists():
        return None, f"npm installed @portkey-ai/gateway@{PORTKEY_VERSION} without {server.name}"
    return server, ""


def run_litellm(python: Path, strategy: str, traces: list[list[Job]], http_ports: dict[str, int],
                stop_below: float | None) -> list[dict]:
    """Each trace through a fresh LiteLLM Router of ``strategy``, until one's SLA attainment is below
    ``stop_below``; per trace run {request index: (e2e ms, engine, completion tokens) or None}."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-litellm-") as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "out.json"
        spec.write_text(json.dumps({
            "strategy": strategy,
            "deployments": {name: f"http://127.0.0.1:{http_ports[name]}/v1" for name in engine_names()},
            "stop_below": stop_below,
            "traces": [[[j.at_s, j.prompt, j.max_tokens, j.sla_ms if j.counted else None] for j in jobs] for jobs in traces]}))
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
               "LITELLM_TELEMETRY": "False", "PYTHONPATH": ""}
        subprocess.run([str(python), str(RUNNER), str(spec), str(out)], check=True, env=env, timeout=3600,
                       stdout=subprocess.DEVNULL)
        return [{int(k): v for k, v in trace.items()} for trace in json.loads(out.read_text())]


def capacity_weight(name: str) -> float:
    """Tokens/s of an engine of this class at a full batch."""
    spec = POOL[name.rsplit("-", 1)[0]]
    step_ms = spec["tpot_ms"] * (1 + spec["batch_slowdown"] * (spec["max_running"] - 1))
    return spec["max_running"] * 1000.0 / step_ms


def portkey_config(weights: str, http_ports: dict[str, int]) -> dict:
    names = engine_names()
    raw = {n: capacity_weight(n) if weights == "capacity" else 1.0 for n in names}
    total = sum(raw.values())
    return {"strategy": {"mode": "loadbalance"}, "retry": {"attempts": 0}, "targets": [
        {"provider": "openai", "api_key": "simulated", "custom_host": f"http://127.0.0.1:{http_ports[n]}/v1",
         "override_params": {"model": n}, "weight": round(raw[n] / total, 4)} for n in names]}


@contextmanager
def portkey_server(server: Path):
    """Portkey's gateway (node) on a free port; yields its base URL."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-portkey-") as tmp:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        log = Path(tmp) / "portkey.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["node", str(server), f"--port={port}", "--headless"], stdout=out,
                                    stderr=subprocess.STDOUT, cwd=tmp)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    httpx2.get(base + "/", timeout=2)
                    break
                except httpx2.HTTPError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"Portkey's gateway did not start: {log.read_text()[-1000:]}") from None
                    time.sleep(0.2)
            yield base
        finally:
            _stop(proc)


async def run_portkey(base: str, config: dict, jobs: list[Job]) -> dict:
    """The jobs at their times through Portkey; {request index: (e2e ms, engine, completion tokens) or None}."""
    headers = {"x-portkey-config": json.dumps(config)}
    records: dict = {}
    limits = httpx2.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx2.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        t0 = time.monotonic() + 0.2

        async def one(index: int, job: Job) -> None:
            await asyncio.sleep(max(0.0, t0 + job.at_s - time.monotonic()))
            began = time.monotonic()
            try:
                response = await client.post("/v1/chat/completions", headers=headers, json={
                    "model": "m", "messages": [{"role": "user", "content": job.prompt}], "max_tokens": job.max_tokens})
                body = response.json()
                if response.status_code != 200:
                    raise RuntimeError(body)
                records[index] = ((time.monotonic() - began) * 1000.0, body["model"],
                                  body["usage"]["completion_tokens"])
            except Exception:  # noqa: BLE001 - a failed request counts against the peer
                records[index] = None

        await asyncio.gather(*(one(i, job) for i, job in enumerate(jobs)))
    return records


@contextmanager
def sim_with_http(engines: list[dict]):
    """The simulator with each engine's HTTP API too; yields {name: http port}."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-sim-http-") as tmp:
        grpc_ports, http_ports = Path(tmp) / "ports.json", Path(tmp) / "http.json"
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gateway.simulator", "--engines", json.dumps(engines),
                                 "--ports-file", str(grpc_ports), "--http-ports-file", str(http_ports)],
                                cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_file(grpc_ports, proc, "the simulator")
            yield json.loads(_wait_file(http_ports, proc, "the simulator"))
        finally:
            _stop(proc)


PEERS = (*(f"litellm-{s}" for s in LITELLM_STRATEGIES), *(f"portkey-loadbalance-{w}" for w in PORTKEY_WEIGHTS))


def run_peer(name: str, traces: list[list[Job]], stop_below: float | None = None) -> list[PolicyResult] | str:
    """The peer ``name`` over each trace (until one's attainment is below ``stop_below``), or why it
    was skipped (its install failed)."""
    if name.startswith("litellm-"):
        python, why = install_litellm()
        if python is None:
            return why
        with sim_with_http(sim_engines()) as http_ports:
            runs = run_litellm(python, name[len("litellm-"):], traces, http_ports, stop_below)
        return [summarize(name, jobs, records) for jobs, records in zip(traces, runs)]
    server, why = install_portkey()
    if server is None:
        return why
    results = []
    with sim_with_http(sim_engines()) as http_ports, portkey_server(server) as base:
        config = portkey_config(name.rsplit("-", 1)[1], http_ports)
        for jobs in traces:
            results.append(summarize(name, jobs, asyncio.run(run_portkey(base, config, jobs))))
            if stop_below is not None and results[-1].attainment < stop_below:
                break
            time.sleep(1.0)  # the pool drains between traces
    return results
