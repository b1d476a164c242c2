"""Processes that end with the process that started them.

The launcher starts each service in a session of its own (so a terminal's Ctrl-C reaches only
``tokenmill up``, which then stops the stack in order). The price: when the launcher dies without
stopping them (SIGKILL, a crash, an interpreter exit past its cleanup), nothing would stop them.
So the launcher names itself in the child's environment (``PARENT_PID_ENV``) and the child, as
it starts, watches for that parent to go: its parent pid changes when the parent dies (the
orphan is re-parented), whatever killed the parent. A pid named in the environment, rather than
the parent pid seen at start, also catches a parent that died before the child looked.

PR_SET_PDEATHSIG would not do: it fires when the *thread* that forked the child ends, and the
launcher starts services from threads that end once the stack serves.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

PARENT_PID_ENV = "TOKENMILL_PARENT_PID"
POLL_S = 0.5


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that must end with this process: ``env`` (default: ours) with
    this process named as its parent."""
    return {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}


def _terminate_self(grace_s: float) -> None:
    """SIGTERM to this process (its graceful stop also stops its own children), then exit
    regardless once ``grace_s`` passed."""
    print(f"parent process gone: stopping (pid {os.getpid()})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(1)


def end_with_parent(grace_s: float = 10.0, on_orphaned: Callable[[], None] | None = None) -> bool:
    """If started by a process that named itself in ``PARENT_PID_ENV``: watch it from a daemon
    thread, and once it is gone call ``on_orphaned`` (default: SIGTERM to this process, then exit
    after ``grace_s``). The variable is removed from our environment, so our own children are
    not told to watch the wrong process. Returns whether a parent is watched."""
    named = os.environ.pop(PARENT_PID_ENV, "")
    if not named.isdigit():
        return False
    parent = int(named)
    action = on_orphaned or (lambda: _terminate_self(grace_s))

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        action()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return True
