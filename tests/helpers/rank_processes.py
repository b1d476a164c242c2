"""Rank processes for the tests that run a collective between real processes.

A spawned rank is a fresh interpreter that imports torch and the test's module before its
first line runs: about 2 s of CPU each, and the shared-memory and expert-parallel tests start
18 of them. A forkserver imports those once (``preload``) and forks every rank from that
clean, single-threaded process, so a rank starts with them already loaded. It is still a
separate process with its own memory, as a spawned one is, so the collectives between ranks
are exercised exactly as before; only the interpreter start-up is shared.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

RANKS_CONTEXT = "TOKENMILL_TEST_RANKS_CONTEXT"
"""Set to ``spawn`` to start each rank as a fresh interpreter instead (what the forkserver replaces)."""


def rank_context(*preload: str) -> BaseContext:
    """A multiprocessing context whose processes start with torch and ``preload`` (module names) imported."""
    import os

    if os.environ.get(RANKS_CONTEXT) == "spawn":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # Read when the forkserver starts (once per test process); a module missing from it is
    # imported in the rank instead, as under spawn.
    context.set_forkserver_preload(["torch", "safetensors.torch", *preload])
    return context
