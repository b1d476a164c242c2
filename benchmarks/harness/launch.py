"""The four services started for a run, as `tokenmill up` starts them (services.stack's Launcher).

A run says what differs (the model, the executor's and the scheduler's flags, the thread
count); the launch adds what every run needs: a log directory, free metrics ports whose
URLs the run can scrape, the repository on PYTHONPATH (a GPU image runs the checkout without
installing it), and the services' quiet log level where the run asks for it.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from benchmarks.harness.paths import REPO_ROOT
from services.common.settings import to_argv
from services.executor.config import ExecutorConfig
from services.scheduler.core.config import SchedulerLimits
from services.stack.launcher import LaunchConfig, Launcher

QUIET_LOGS = {name: "warning" for name in (
    "TOKENMILL_LOG_LEVEL", "TOKENMILL_SCHEDULER_LOG_LEVEL", "TOKENMILL_EXECUTOR_LOG_LEVEL",
    "TOKENMILL_TOKENIZER_LOG_LEVEL", "TOKENMILL_DRAFTER_LOG_LEVEL")}
"""Every service at warning: a request's info lines cost the scheduler CPU the run measures."""


def free_port() -> int:
    """A loopback port free at the time of asking (for a service's --metrics-port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def executor_flags(config: ExecutorConfig, *, only_changed: bool = False) -> list[str]:
    """The executor service's flags for ``config`` (the launcher gives the model itself). Every
    field spelled out unless ``only_changed``: the service then runs with exactly this config,
    whatever its environment says."""
    argv = to_argv(config, only_changed=only_changed)
    if "--model" in argv:
        model = argv.index("--model")
        del argv[model:model + 2]
    return argv


def scheduler_flags(limits: SchedulerLimits, *, only_changed: bool = False) -> list[str]:
    """The scheduler service's flags for ``limits`` (every limit spelled out unless ``only_changed``)."""
    return to_argv(limits, only_changed=only_changed)


def service_env(threads: int | None = None, *, quiet: bool = True, extra: dict[str, str] | None = None,
                python_path: str | None = None) -> dict[str, str]:
    """The services' environment: ``threads`` OpenMP/MKL threads each (the count the in-process
    systems get through torch.set_num_threads), the checkout on PYTHONPATH (``python_path``
    goes first), QUIET_LOGS when ``quiet``, then ``extra``."""
    paths = [p for p in (python_path, str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    if threads is not None:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if quiet:
        env |= QUIET_LOGS
    return env | (extra or {})


@dataclass(frozen=True, slots=True)
class Stack:
    """A stack a run talks to: started by ``launched``, or one already running (``address``)."""

    address: str
    scheduler_metrics: str | None = None
    """http://host:port/metrics of the scheduler, when known."""
    executor_metrics: str | None = None
    log_dir: str | None = None
    pids: dict[str, int] = field(default_factory=dict)
    """Service name -> process id, when this run started them (for their CPU time)."""
    launcher: Launcher | None = None


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """What a run's stack differs in; the rest is the launcher's defaults."""

    model: str
    executor_args: tuple[str, ...] = ()
    scheduler_args: tuple[str, ...] = ()
    drafter_args: tuple[str, ...] = ()
    threads: int | None = 1
    """OpenMP threads of each service (None: the services' environment decides)."""
    quiet: bool = True
    """QUIET_LOGS for every service."""
    restart: bool = False
    """Restart a service that exits (the runs that kill one on purpose)."""
    metrics: bool = True
    """Scheduler and executor metrics on free ports (Stack.scheduler_metrics, executor_metrics)."""
    start_timeout_s: float = 120.0
    env: tuple[tuple[str, str], ...] = ()
    """More environment for every service."""
    python_path: str | None = None
    """A directory put first on the services' PYTHONPATH (a sitecustomize that traces them)."""
    log_prefix: str = "tokenmill-bench-"
    executor_roles: tuple[str, ...] = ("mixed",)
    """One executor per entry, with that role, all behind the one scheduler. With several,
    the executors get no metrics port (they would share one); GetProfile has their figures."""

    def launch_config(self) -> tuple[LaunchConfig, int | None, int | None]:
        """The launcher's config, and the scheduler's and executor's metrics ports (None without metrics)."""
        scheduler_port = free_port() if self.metrics else None
        executor_port = free_port() if self.metrics and len(self.executor_roles) == 1 else None
        executor_args = list(self.executor_args) + (["--metrics-port", str(executor_port)] if executor_port else [])
        scheduler_args = list(self.scheduler_args) + (["--metrics-port", str(scheduler_port)] if self.metrics else [])
        config = LaunchConfig(
            model=self.model, public_port=0, log_dir=tempfile.mkdtemp(prefix=self.log_prefix + "logs-"),
            restart=self.restart, start_timeout_s=self.start_timeout_s,
            executor_args=executor_args, scheduler_args=scheduler_args, drafter_args=list(self.drafter_args),
            executor_roles=list(self.executor_roles),
            env=service_env(self.threads, quiet=self.quiet, extra=dict(self.env), python_path=self.python_path))
        return config, scheduler_port, executor_port


def stack_of(launcher: Launcher, scheduler_port: int | None, executor_port: int | None) -> Stack:
    """The Stack a started launcher serves."""
    def url(port: int | None) -> str | None:
        return None if port is None else f"http://127.0.0.1:{port}/metrics"

    return Stack(launcher.public_address, url(scheduler_port), url(executor_port), launcher.config.log_dir,
                 {name: svc.process.pid for name, svc in launcher.services.items() if svc.process is not None},
                 launcher)


@contextmanager
def launched(spec: LaunchSpec, launcher_cls: type[Launcher] = Launcher, **launcher_kwargs) -> Iterator[Stack]:
    """Start the four services (stopped on exit); yields their Stack. ``launcher_cls`` and its
    extra arguments: a run's own Launcher (the stress suite's, which can run one under heaptrack)."""
    config, scheduler_port, executor_port = spec.launch_config()
    launcher = launcher_cls(config, **launcher_kwargs)
    launcher.start()
    try:
        yield stack_of(launcher, scheduler_port, executor_port)
    finally:
        launcher.stop()
