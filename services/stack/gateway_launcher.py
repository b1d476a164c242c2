"""Run the gateway as a local process in front of engines started by ``Launcher``s.

``replica_routes`` writes the routes of one model served by N identical engines (a ``latency``
route: equal costs, so each request goes to the replica with the lowest estimate at its live
load); ``GatewayProcess`` starts ``python -m services.gateway`` on it, waits until both its
ports are published, and stops it with SIGTERM (before the engines, so client streams end
cleanly).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.common.parent_watch import child_env
from services.common.service_config import read_port_file


def replica_routes(model_id: str, addresses: list[str], tokenizer: str = "") -> dict:
    """The routes file of ``model_id`` served by the engines at ``addresses``."""
    targets = [{"name": f"replica-{i}", "address": address} for i, address in enumerate(addresses)]
    route: dict = {"route": {"strategy": "latency", "targets": [t["name"] for t in targets]}}
    if tokenizer:
        route["tokenizer"] = tokenizer
    return {"targets": targets, "models": {model_id: route}}


@dataclass
class GatewayProcess:
    routes: dict
    state_dir: Path
    host: str = "127.0.0.1"
    grpc_port: int = 50050
    http_port: int = 8000
    log_path: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        config = self.state_dir / "gateway-routes.json"
        config.write_text(json.dumps(self.routes, indent=1))
        grpc_file, http_file = self.state_dir / "gateway.port", self.state_dir / "gateway-http.port"
        for path in (grpc_file, http_file):
            path.unlink(missing_ok=True)
        log = open(self.log_path, "ab") if self.log_path is not None else None
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.gateway", "--config", str(config), "--host", self.host,
             "--port", str(self.grpc_port), "--port-file", str(grpc_file), "--http-port", str(self.http_port),
             "--http-port-file", str(http_file), *self.extra_args],
            env=child_env({**os.environ, **self.env}), stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        if log is not None:
            log.close()  # the child holds its own descriptor
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited with code {self.process.returncode} while starting"
                                   + (f": {self._last_log_line()} (see {self.log_path})" if self.log_path else ""))
            grpc_port, http_port = read_port_file(grpc_file), read_port_file(http_file)
            if grpc_port is not None and http_port is not None:
                self.grpc_port, self.http_port = grpc_port, http_port
                return
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"the gateway did not start within {timeout_s:.0f}s")

    def _last_log_line(self) -> str:
        """What the gateway said last (a refused setting is one line, service_main's)."""
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1] if lines else ""

    @property
    def client_host(self) -> str:
        """Where a client on this machine reaches it: loopback when it listens on every interface."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "[::]", "") else self.host

    @property
    def http_base(self) -> str:
        return f"http://{self.client_host}:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    def stop(self, timeout_s: float = 15.0) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
