"""The gateway run as a process, as a user starts it: flags typed on its command line, ports
written to files, ready once /health answers 200."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses

from tests.helpers.service_harness import REPO_ROOT


@dataclass
class GatewayProcess:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


async def start_gateway(root: Path, routes: str, flags: Sequence[str] = (), env: dict[str, str] | None = None,
                        timeout_s: float = 60.0) -> GatewayProcess:
    """``python -m services.gateway --config ROUTES --port 0 --http-port 0 FLAGS``; returns once
    its HTTP port is written."""
    port_file = root / f"http-{time.monotonic_ns()}.port"
    grpc_port_file = root / f"grpc-{time.monotonic_ns()}.port"
    log = root / f"gateway-{time.monotonic_ns()}.log"
    command = [sys.executable, "-m", "services.gateway", "--config", routes, "--port", "0", "--http-port", "0",
               "--http-port-file", str(port_file), "--port-file", str(grpc_port_file), "--profile-interval-s", "0.1",
               *flags]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})
    deadline = time.monotonic() + timeout_s
    while not (port_file.exists() and grpc_port_file.exists()):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the gateway did not start: {log.read_text()[-3000:]}")
        await asyncio.sleep(0.1)
    gateway = GatewayProcess(process, int(port_file.read_text()), int(grpc_port_file.read_text()), log)
    async with httpx.AsyncClient(base_url=gateway.base, timeout=10) as client:
        while (await client.get("/health")).status_code != 200:
            assert time.monotonic() < deadline, f"the gateway never became healthy: {log.read_text()[-3000:]}"
            await asyncio.sleep(0.1)
    return gateway
