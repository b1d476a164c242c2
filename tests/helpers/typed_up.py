"""`tokenmill up` started the way a person starts it: a command line typed in a shell, in a
directory, with environment variables; what it prints is read as they read it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import stack_logs
from tests.helpers.service_harness import REPO_ROOT

SERVING = "Ctrl-C to stop"
MAKE_RUN = '.venv/bin/tokenmill up --model "models/smollm2-135m-instruct-q4_1"'
"""`make run`'s recipe (from ``make -n``, install done), checked against the Makefile each start."""
MAKE_RUN_MODEL = "smollm2-135m-instruct-q4_1"
"""The model id `make run`'s stack serves."""
PRINTED = re.compile(r"^\[tokenmill up\]   (.+)$", re.M)
"""An indented line under `[tokenmill up]`: a command printed for the user to run."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def moved_ports() -> dict[str, str]:
    """The documented variables that move `tokenmill up`'s fixed ports (make run's 8000, 50050,
    50051) to free ones, so a test runs beside a stack a person started."""
    return {"TOKENMILL_SCHEDULER_PORT": str(free_port()), "TOKENMILL_GATEWAY_HTTP_PORT": str(free_port()),
            "TOKENMILL_GATEWAY_PORT": str(free_port())}


def user_env(**extra: str) -> dict[str, str]:
    """This environment with the test's own settings of tokenmill removed (a person's shell has
    none), this checkout's code first on the path, one thread a service."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    env.update(extra)
    return env


@dataclass
class TypedUp:
    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    stdout: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, needle: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if needle in self.text:
                return self.text
            if self.process.poll() is not None:
                time.sleep(0.2)  # the reader thread's last lines
                break
            time.sleep(0.1)
        raise AssertionError(f"`tokenmill up` did not print {needle!r} (exit {self.process.poll()}):\n{self.text}")

    def printed_commands(self) -> list[str]:
        """The commands it printed for the user: the indented lines, and the `...` of `try `...``."""
        found = [line for line in PRINTED.findall(self.text) if not line.startswith("(")]
        found += re.findall(r"try `([^`]+)`", self.text)
        return found

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise


def start_up(command: str | list[str], env: Mapping[str, str], cwd: Path = REPO_ROOT) -> TypedUp:
    """Run ``command`` (a shell line, or argv) in ``cwd``; its stderr and stdout are collected as
    they come. Its own process group, so a failed test can kill all of it."""
    shell = isinstance(command, str)
    process = subprocess.Popen(["bash", "-c", f"exec {command}"] if shell else command, cwd=cwd, env=dict(env),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    up = TypedUp(process)

    def read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    threading.Thread(target=read, args=(process.stderr, up.lines), daemon=True).start()
    threading.Thread(target=read, args=(process.stdout, up.stdout), daemon=True).start()
    stack_logs.remember(f"`{command if shell else ' '.join(command)}` (stderr, then stdout)",
                        lambda: up.text + "".join(up.stdout))
    return up


@contextmanager
def make_run_stack(log_dir: Path) -> Iterator[tuple[TypedUp, dict[str, str]]]:
    """A stack started exactly as `make run` starts it: its recipe, from the repository's root,
    the model path relative as typed, only the documented variables moving its ports (so it runs
    beside a person's own stack). Yields the running `tokenmill up` and the environment its
    clients use; stops it (Ctrl-C) after, asserting a clean exit."""
    recipe = subprocess.run(["make", "--no-print-directory", "-s", "-n", "-o", "install", "run"], cwd=REPO_ROOT,
                            env=user_env(), capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert recipe == MAKE_RUN, recipe
    if not (REPO_ROOT / "models" / MAKE_RUN_MODEL / "config.json").exists():
        pytest.fail(f"models/{MAKE_RUN_MODEL} is missing: make install converts it")
    env = user_env(**moved_ports(), TOKENMILL_LOG_DIR=str(log_dir))
    up = start_up(recipe, env)
    try:
        up.wait_for(SERVING, 300)
        yield up, env
    finally:
        assert up.stop() == 0, up.text
