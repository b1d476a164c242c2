"""llama-cpp-python as the tests that start llama.cpp's server need it.

`make test` builds it (pip, from source: minutes of compiling) in the background, niced, while the
suite runs, and gives the build's process id in TOKENMILL_LLAMA_CPP_BUILD_PID and its log in
TOKENMILL_LLAMA_CPP_BUILD_LOG; the tests marked `llama_cpp` run last (tests/conftest.py) and wait
here for that build to end. Without the variables (pytest run by hand) llama-cpp-python must
already be installed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
from pathlib import Path

# The build normally ends long before the suite reaches the last tests; this only bounds a stuck one
# (pytest-timeout's 600 s per test still applies around it).
WAIT_S = 540.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a finished child of another process may linger as a zombie until make reaps it
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _log_tail() -> str:
    log = os.environ.get("TOKENMILL_LLAMA_CPP_BUILD_LOG")
    if not log or not Path(log).is_file():
        return ""
    return "\n" + Path(log).read_text(errors="replace")[-3000:]


def wait_for_exit(pid: int, wait_s: float, poll_s: float = 1.0) -> None:
    """Return once process `pid` (not a child of ours) has ended; fail after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while _alive(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"make's build of llama-cpp-python (pid {pid}) still runs after "
                                 f"{wait_s:.0f} s{_log_tail()}")
        time.sleep(poll_s)


@functools.cache
def require_llama_cpp() -> None:
    """Wait for make's background build of llama-cpp-python, then check that llama_cpp imports."""
    pid = os.environ.get("TOKENMILL_LLAMA_CPP_BUILD_PID")
    if pid:
        wait_for_exit(int(pid), WAIT_S)
    importlib.invalidate_caches()
    if importlib.util.find_spec("llama_cpp") is None:
        raise AssertionError("llama-cpp-python is not installed (`make test` builds it; by hand: "
                             f"`make .venv/.llama-cpp-python`){_log_tail()}")
