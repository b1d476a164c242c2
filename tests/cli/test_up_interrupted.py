"""`tokenmill up` stopped while it starts, as a person stops it: Ctrl-C in the terminal (SIGINT to
its process group), SIGTERM, or SIGKILL. No service it started outlives it, and (but for SIGKILL,
which no process can clean up after) its temporary directories are gone.

Once Ctrl-C during start-up left the tokenizer, executor and drafter running without a parent:
the services run in sessions of their own, and the interrupt unwound `up` past its clean-up while
its start threads went on starting them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.typed_up import moved_ports, start_up, user_env

pytestmark = pytest.mark.slow

UP = ".venv/bin/tokenmill up"


def _processes_naming(text: str) -> dict[int, str]:
    """pid -> command line of every process whose command line holds ``text``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in argv:
            found[int(entry.name)] = argv
    return found


def _wait_for(predicate, timeout_s: float, what: str, up) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout_s:.0f}s:\n{up.text}")


@pytest.mark.parametrize("moment, sig, inherited", [
    ("services", signal.SIGINT, "default"),   # Ctrl-C while the backends load
    # Ctrl-C reaching an up whose shell ignored SIGINT (a background job, a CI runner): it once
    # went on to serve, since Python leaves an inherited SIG_IGN in place.
    ("services", signal.SIGINT, "ignored"),
    ("gateway", signal.SIGTERM, "default"),   # SIGTERM while the gateway starts, the engine up
    ("services", signal.SIGKILL, "default"),  # killed outright: the services see their parent gone
])
def test_up_stopped_while_starting_leaves_no_process_and_no_run_directory(tmp_path, moment, sig, inherited):
    tmp = tmp_path / "tmp"  # up's temporary directories land here: they and their users are this test's
    tmp.mkdir()
    # The engine need not be warm to show the gateway's moment (start-up is minutes on a loaded machine).
    command = UP + (" --executor-arg=--skip-warmup" if moment == "gateway" else "")
    if inherited == "ignored":
        command = ["bash", "-c", f"trap '' INT; exec {command}"]
    up = start_up(command, user_env(**moved_ports(), TMPDIR=str(tmp), TOKENMILL_LOG_DIR=str(tmp_path / "logs")))
    ours = f" {tmp}/"
    try:
        needle = "services.gateway" if moment == "gateway" else "services."
        _wait_for(lambda: any(needle in argv for argv in _processes_naming(ours).values()), 240,
                  f"no {needle} process of `up` started", up)
        if sig == signal.SIGINT:
            os.killpg(up.process.pid, sig)  # the terminal's Ctrl-C: the whole foreground process group
        else:
            up.process.send_signal(sig)
        code = up.process.wait(60)
        # The services' own grace (5 s) and the parent watch's poll bound how long a SIGKILLed up's
        # services live on; up itself waits for each to stop before it exits.
        _wait_for(lambda: not _processes_naming(ours), 30 if sig == signal.SIGKILL else 1,
                  f"processes of `up` outlived it: {_processes_naming(ours)}", up)
        if sig == signal.SIGKILL:
            assert code == -signal.SIGKILL
            return
        assert code == 130, up.text
        assert "interrupted while starting" in up.text
        assert list(tmp.iterdir()) == [], up.text
    finally:
        for pid in _processes_naming(ours):
            os.kill(pid, signal.SIGKILL)
