"""Run the four services as local processes, keep them up, stop them cleanly.

Internal services (tokenizer, executor, drafter) bind port 0 by default and report the port
through a port file; after the first start a service keeps its port, so a restarted
executor is found by the scheduler at the same address. The scheduler (the public API)
binds the configured public port. A service that dies is restarted (with a back-off);
stopping sends SIGTERM to the scheduler first, so client streams end cleanly, then to the rest.

With ``tls`` the launcher makes a throwaway CA and certificates for loopback in its run
directory (services/stack/dev_ca.py) and every hop is mTLS: each service serves the server
certificate and requires a client certificate from that CA; the scheduler presents its own to
the backends, which accept no other (``--tls-allowed-clients``), the launcher's health checks
use it for the backends (``Launcher.internal_tls``), and the demo client and users get the
client certificate (``Launcher.client_tls``), good for the public API only.

Whatever ``tls`` is, the launcher writes a fresh internal secret to its run directory (mode 0600,
services/common/internal_secret.py) and names that file to every service: the tokenizer, the
executors and the drafter answer no call without it (health excepted), and the scheduler and the
executors present it. A local process that is not the stack's own cannot drive an executor.

With prefill executors, the others may pull a prompt's KV from them, and from them alone
(``--kv-peers``): they start once the prefill executors serve, whose addresses they are then told.

``stop()`` may be called from another thread while ``start()`` runs (Ctrl-C during start-up):
no process starts after it, and ``start()`` raises StartInterrupted. Each service also watches
this process and ends if it dies unstopped (services/common/parent_watch.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.internal_secret import write_secret_file
from services.common.parent_watch import child_env
from services.common.tls import ClientTLS
from services.stack.client import open_channel
from services.stack.dev_ca import EXECUTOR_IDENTITY, SCHEDULER_IDENTITY, DevCertificates, write_dev_certificates


class StartInterrupted(RuntimeError):
    """``stop()`` was called while ``start()`` was still starting the stack (from another thread)."""


@dataclass
class ServiceProcess:
    name: str
    """Unique in the stack: the service kind, numbered after the first (executor, executor-1, ...)."""
    args: list[str]
    port: int
    port_file: Path
    log_path: Path | None
    process: subprocess.Popen | None = None
    restarts: int = 0
    log_handle: object = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def kind(self) -> str:
        """The service this process runs (its module: services.<kind>)."""
        return self.name.split("-")[0]


@dataclass
class LaunchConfig:
    model: str
    public_host: str = "127.0.0.1"
    public_port: int = 50051
    internal_ports: dict[str, int] = field(default_factory=dict)
    """Fixed ports for tokenizer / executor / drafter (missing = any free port)."""
    executor_args: list[str] = field(default_factory=list)
    """Extra flags for every executor (dtype, device, kv cache size, ...)."""
    executor_role_args: dict[str, list[str]] = field(default_factory=dict)
    """Extra flags for the executors of one role (after executor_args: they win)."""
    executor_roles: list[str] = field(default_factory=lambda: ["mixed"])
    """One executor per entry, with that role (mixed, prefill or decode), all behind the one
    scheduler; the first is named "executor", the others "executor-1", "executor-2", ..."""
    scheduler_args: list[str] = field(default_factory=list)
    tokenizer_args: list[str] = field(default_factory=list)
    """Extra flags for the tokenizer (--chat-template ...)."""
    drafter_args: list[str] = field(default_factory=list)
    """Extra flags for the drafter (--method draft_model --draft-model DIR, ...); it is always
    told the target's directory (--target-model), so a draft of another vocabulary is refused."""
    log_dir: str | None = None
    """Each service's stderr goes to LOG_DIR/NAME.log (None = inherit the launcher's stderr)."""
    start_timeout_s: float = 120.0
    restart: bool = True
    env: dict[str, str] = field(default_factory=dict)
    on_event: Callable[[str], None] | None = None
    """Called with each supervision event as it happens (a service exited, restarted, failed to
    restart), from the supervisor thread; every event is also kept in ``Launcher.events``."""
    tls: bool = False
    """mTLS on every hop, with a throwaway local CA written to the run directory."""


class Launcher:
    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self._state_dir = Path(tempfile.mkdtemp(prefix="tokenmill-up-"))
        self.services: dict[str, ServiceProcess] = {}
        self._stopping = threading.Event()
        self._spawn_lock = threading.Lock()
        """Held while the supervisor checks _stopping and spawns, and while stop() sets it: a
        restart can then never start a process after stop() went past its service."""
        self._monitor: threading.Thread | None = None
        self.events: list[str] = []
        self.secret_file = write_secret_file(self._state_dir / "internal-secret")
        """The stack's internal secret (services/common/internal_secret.py), read by every service."""
        self.certificates: DevCertificates | None = (
            write_dev_certificates(self._state_dir / "tls") if config.tls else None)
        """The CA, server and client certificate files (with ``tls``)."""

    @property
    def run_dir(self) -> Path:
        """The launcher's temporary directory (port files, TLS certificates); see remove_run_dir."""
        return self._state_dir

    def remove_run_dir(self) -> None:
        """Once stopped: delete the run directory, so a stop leaves nothing behind in /tmp."""
        shutil.rmtree(self._state_dir, ignore_errors=True)

    @property
    def client_tls(self) -> ClientTLS | None:
        """How a client connects to this stack's public API (None: plaintext)."""
        certs = self.certificates
        return ClientTLS(str(certs.ca), str(certs.client_cert), str(certs.client_key)) if certs else None

    @property
    def internal_tls(self) -> ClientTLS | None:
        """How the scheduler (and the launcher's health checks) reach the backends: with the
        scheduler's certificate, the only client they accept."""
        certs = self.certificates
        return ClientTLS(str(certs.ca), str(certs.scheduler_cert), str(certs.scheduler_key)) if certs else None

    # ------------------------------------------------------------------ start
    def command(self, name: str, port: int = 0) -> list[str]:
        """The command line the launcher runs service ``name`` (executor-1, say) with on ``port``;
        the scheduler's names its backends, so the stack must have been laid out (``start``)."""
        return self._command(ServiceProcess(name, [], port, self._state_dir / f"{name}.port", None))

    def _command(self, svc: ServiceProcess) -> list[str]:
        c = self.config
        name = svc.kind
        base = [sys.executable, "-m", f"services.{name}", "--port", str(svc.port), "--port-file", str(svc.port_file)]
        if name in ("tokenizer", "executor"):
            base += ["--model", c.model]
        if name == "tokenizer":
            base += c.tokenizer_args
        if name == "executor":
            role = c.executor_roles[self.executor_names.index(svc.name)]
            base += (["--role", role] if role != "mixed" else []) + c.executor_args + c.executor_role_args.get(role, [])
            if role != "prefill" and (peers := self._prefill_names()):
                base += ["--kv-peers", ",".join(self.services[n].address for n in peers)]
        if name == "drafter":
            base += ["--target-model", c.model] + c.drafter_args
        base += ["--internal-secret-file", str(self.secret_file)]
        if self.certificates is not None:
            certs = self.certificates
            base += ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                     "--tls-client-ca", str(certs.ca)]
            if name == "scheduler":
                base += ["--backend-tls-ca", str(certs.ca), "--backend-tls-cert", str(certs.scheduler_cert),
                         "--backend-tls-key", str(certs.scheduler_key)]
            else:  # a backend: only the scheduler may call it (the public client certificate may not)
                base += ["--tls-allowed-clients", SCHEDULER_IDENTITY]
            if name == "executor":  # and the other executors, to read KV blocks (disaggregated prefill)
                base += ["--tls-peer-clients", EXECUTOR_IDENTITY, "--backend-tls-ca", str(certs.ca),
                         "--backend-tls-cert", str(certs.executor_cert), "--backend-tls-key", str(certs.executor_key)]
        if name == "scheduler":
            base += ["--host", c.public_host,
                     "--executor-addresses", ",".join(self.services[n].address for n in self.executor_names),
                     "--tokenizer-addresses", self.services["tokenizer"].address,
                     "--drafter-address", self.services["drafter"].address] + c.scheduler_args
        return base

    def _spawn(self, svc: ServiceProcess) -> None:
        svc.port_file.unlink(missing_ok=True)
        env = child_env({**os.environ, **self.config.env})  # it ends when we do, however we end
        stderr = None
        if svc.log_handle is not None:
            svc.log_handle.close()  # the previous (dead) process's handle
        if svc.log_path is not None:
            svc.log_handle = open(svc.log_path, "ab")
            stderr = svc.log_handle
        svc.process = subprocess.Popen(self._command(svc), env=env, stdout=subprocess.DEVNULL,
                                       stderr=stderr, start_new_session=True)

    def _wait_serving(self, svc: ServiceProcess, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._stopping.is_set():
                raise StartInterrupted(f"stopped while {svc.name} was starting")
            if svc.process.poll() is not None:
                raise RuntimeError(f"{svc.name} exited with code {svc.process.returncode} while starting"
                                   + (f"; see {svc.log_path}" if svc.log_path else ""))
            if svc.port_file.is_file() and svc.port_file.read_text().strip():
                svc.port = int(svc.port_file.read_text())
                tls = self.client_tls if svc.kind == "scheduler" else self.internal_tls
                if health_status(svc.address, timeout=1.0, tls=tls) == "SERVING":
                    return
            time.sleep(0.05)
        raise TimeoutError(f"{svc.name} did not report SERVING within {timeout:.0f}s")

    @property
    def executor_names(self) -> list[str]:
        return ["executor" if i == 0 else f"executor-{i}" for i in range(len(self.config.executor_roles))]

    def _prefill_names(self) -> list[str]:
        return [n for n, role in zip(self.executor_names, self.config.executor_roles) if role == "prefill"]

    def _service_names(self) -> list[str]:
        """In start order: the backends (loaded in parallel), then the scheduler."""
        return ["tokenizer", *self.executor_names, "drafter", "scheduler"]

    def start(self) -> None:
        log_dir = Path(self.config.log_dir) if self.config.log_dir else None
        if log_dir:
            log_dir.mkdir(parents=True, exist_ok=True)
        for name in self._service_names():
            port = self.config.public_port if name == "scheduler" else self.config.internal_ports.get(name, 0)
            svc = ServiceProcess(name, [], port, self._state_dir / f"{name}.port",
                                 log_dir / f"{name}.log" if log_dir else None)
            self.services[name] = svc
        backends = self._service_names()[:-1]
        first = [n for n in backends if n not in self.executor_names or n in self._prefill_names()
                 or not self._prefill_names()]
        try:
            # The backends load in parallel (the executors that pull KV from the prefill ones once
            # those have their ports); the scheduler needs every address.
            for wave in (first, [n for n in backends if n not in first]):
                for name in wave:
                    self._spawn_unless_stopping(self.services[name])
                for name in wave:
                    self._wait_serving(self.services[name], self.config.start_timeout_s)
            self._spawn_unless_stopping(self.services["scheduler"])
            self._wait_serving(self.services["scheduler"], self.config.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        if self.config.restart:
            self._monitor = threading.Thread(target=self._supervise, name="tokenmill-supervisor", daemon=True)
            self._monitor.start()

    def _spawn_unless_stopping(self, svc: ServiceProcess) -> None:
        """Spawn, unless stop() (from another thread: Ctrl-C during start-up) went first; under the
        lock stop() sets its flag under, so it either sees this process or this never starts."""
        with self._spawn_lock:
            if self._stopping.is_set():
                raise StartInterrupted(f"stopped before {svc.name} started")
            self._spawn(svc)

    @property
    def public_address(self) -> str:
        return self.services["scheduler"].address

    # ------------------------------------------------------------------ supervise
    def _event(self, text: str) -> None:
        self.events.append(text)
        if self.config.on_event is not None:
            self.config.on_event(text)

    def _supervise(self) -> None:
        backoff: dict[str, float] = {}
        while not self._stopping.wait(0.2):
            for svc in self.services.values():
                if svc.process is None or svc.process.poll() is None:
                    continue
                if self._stopping.is_set():
                    return
                self._event(f"{svc.name} exited with code {svc.process.returncode}; restarting")
                if self._stopping.wait(backoff.get(svc.name, 0.0)):
                    return
                backoff[svc.name] = min(2 * backoff.get(svc.name, 0.25), 5.0)
                with self._spawn_lock:
                    if self._stopping.is_set():
                        return
                    svc.restarts += 1
                    self._spawn(svc)  # same port as before: peers find it at the same address
                try:
                    self._wait_serving(svc, self.config.start_timeout_s)
                    # Forget the back-off (not 0.0: the doubling above would keep 0 forever).
                    backoff.pop(svc.name, None)
                    self._event(f"{svc.name} restarted")
                except StartInterrupted:
                    return
                except (RuntimeError, TimeoutError) as exc:
                    self._event(f"{svc.name} restart failed: {exc}")

    # ------------------------------------------------------------------ stop
    def stop(self, timeout: float = 15.0) -> None:
        with self._spawn_lock:
            self._stopping.set()
        for name in reversed(list(self.services)):
            svc = self.services.get(name)
            if svc is None or svc.process is None or svc.process.poll() is not None:
                continue
            svc.process.send_signal(signal.SIGTERM)
            try:
                svc.process.wait(timeout)
            except subprocess.TimeoutExpired:
                svc.process.kill()
                svc.process.wait()
        for svc in self.services.values():
            if svc.log_handle is not None:
                svc.log_handle.close()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=2)


def health_status(address: str, service: str = "", timeout: float = 2.0, tls: ClientTLS | None = None) -> str:
    """The service's health, or UNREACHABLE; over TLS with ``tls``, else plaintext."""
    with open_channel(address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                            timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
