"""The processes a gateway benchmark starts: engine simulators and gateways, waited for by port file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from benchmarks.harness.paths import REPO_ROOT


def _wait_file(path: Path, proc: subprocess.Popen, what: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        if path.is_file() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not start within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _prefix(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


@contextmanager
def simulator(engines: list[dict], cpus: str | None = None):
    """A simulator process serving ``engines``; yields ({name: address}, pid)."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-sim-") as tmp:
        ports = Path(tmp) / "ports.json"
        proc = subprocess.Popen([*_prefix(cpus), sys.executable, "-m", "benchmarks.gateway.simulator",
                                 "--engines", json.dumps(engines), "--ports-file", str(ports)],
                                cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            text = _wait_file(ports, proc, "the simulator")
            yield {name: f"127.0.0.1:{port}" for name, port in json.loads(text).items()}, proc.pid
        finally:
            _stop(proc)


@contextmanager
def gateway(routes: dict, cpus: str | None = None, args: tuple[str, ...] = (), start_timeout_s: float = 60.0):
    """A gateway process over ``routes``; yields (grpc address, http base url, pid). A gateway that
    exits while starting fails at once; ``start_timeout_s`` bounds one that is merely slow."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-gw-") as tmp:
        config = Path(tmp) / "routes.json"
        config.write_text(json.dumps(routes))
        grpc_file, http_file = Path(tmp) / "grpc.port", Path(tmp) / "http.port"
        # exec: with taskset the pid is the gateway's own
        proc = subprocess.Popen([*_prefix(cpus), sys.executable, "-m", "services.gateway", "--config", str(config),
                                 "--port", "0", "--port-file", str(grpc_file), "--http-port", "0",
                                 "--http-port-file", str(http_file), "--log-level", "warning", *args],
                                cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            grpc_port = _wait_file(grpc_file, proc, "the gateway", start_timeout_s).strip()
            http_port = _wait_file(http_file, proc, "the gateway", start_timeout_s).strip()
            yield f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", proc.pid
        finally:
            _stop(proc)
