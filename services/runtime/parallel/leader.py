"""Rank 0's side of a tensor-parallel executor: start the other ranks, hand them each step,
watch them.

The other ranks are processes of their own (``python -m services.runtime.parallel.worker``),
started before rank 0 loads its own shard so that all load at once. They meet at a FileStore
in a directory private to the executor's user (mode 0700, removed at close), not at a TCPStore:
torch.distributed's TCPStore takes no credentials and lists its keys to anyone who connects on
loopback, who could then read the shared-memory segment's path or write the rendezvous keys
(gloo's addresses) before the ranks do. A file store is reached only through its directory, and
each gloo connection of the group proves a secret made here at launch (pair_auth.py). A rank
that exits while the executor runs is a lost executor: the watcher logs which rank and how it ended, calls the ``on_lost``
callbacks (the executor service ends its process there), and every later step raises
TensorParallelError with that reason, as does the step that was waiting on it. So does a step
that fails on rank 0 itself (``lose``): the other ranks may be inside that step's collectives,
and no later step could meet them there.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import structlog
import torch
import torch.distributed as dist

from services.common.parent_watch import child_env
from services.runtime.model.attention.base import AttentionMetadata
from services.runtime.parallel.collectives import STEP, RankGroups
from services.runtime.parallel.pair_auth import new_secret
from services.runtime.parallel.rank import RankSpec

_log = structlog.get_logger("tokenmill.parallel")

LOAD_TIMEOUT_S = 3600.0
"""How long rank 0 waits for the other ranks to load their shards."""
STOP_TIMEOUT_S = 10.0
PEER_EXIT_WAIT_S = 0.5
"""After a failed step, how long rank 0 looks for a rank's exit that would explain it."""

T = TypeVar("T")


class TensorParallelError(RuntimeError):
    """A rank of the group is gone: the executor cannot run another step."""


def open_store(path: str, world: int) -> dist.FileStore:
    """The group's rendezvous store at ``path`` (every rank opens the same file)."""
    store = dist.FileStore(path, world)
    store.set_timeout(timedelta(seconds=LOAD_TIMEOUT_S))
    return store


class TensorParallelLeader:
    def __init__(self, specs: Callable[[int, str], RankSpec], world: int) -> None:
        """``specs(rank, store_path)``: what rank ``rank`` (1 .. world - 1) is told."""
        self.world = world
        self.store_dir = tempfile.mkdtemp(prefix="tokenmill-tp-")
        """Where the rendezvous store lives: mode 0700, this user's alone; removed at close."""
        store_path = os.path.join(self.store_dir, "store")
        self.store = open_store(store_path, world)
        self.groups: RankGroups | None = None
        self.failure: str | None = None
        self.kv_bytes: list[int] = []
        """Each rank's KV pool, in bytes, once joined."""
        self._closing = False
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[str], None]] = []
        self._secret = new_secret()
        """Every gloo connection of the group proves it (pair_auth.py); the ranks read it from
        their stdin, where no other process can."""
        self._procs = []
        for rank in range(1, world):
            proc = subprocess.Popen([sys.executable, "-m", "services.runtime.parallel.worker",
                                     specs(rank, store_path).to_json()], stdin=subprocess.PIPE,
                                    env=child_env())
            proc.stdin.write(self._secret)
            proc.stdin.close()
            self._procs.append(proc)
        atexit.register(self._kill)
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-watch-{rank}", daemon=True).start()
        _log.info("tensor_parallel_ranks_started", world=world, pids=[p.pid for p in self._procs],
                  store_path=store_path)

    @property
    def pids(self) -> list[int]:
        """The other ranks' process ids, rank 1 first."""
        return [p.pid for p in self._procs]

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (from the watcher thread) when a rank ends while in use."""
        self._callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._closing:
            return
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        reason = f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"
        if self._fail(reason):
            _log.error("tensor_parallel_rank_lost", rank=rank, pid=proc.pid, returncode=code, reason=reason)
            self._after_failure()

    def _fail(self, reason: str) -> bool:
        """Record the group's first failure; whether this was it."""
        with self._lock:
            if self.failure is not None:
                return False
            self.failure = reason
            return True

    def _after_failure(self) -> None:
        if self.groups is not None and self.groups.step_segment is not None:
            self.groups.step_segment.abort()  # every rank waiting in the segment fails at once
        for callback in self._callbacks:
            callback(self.failure)

    def lose(self, reason: str) -> TensorParallelError:
        """Rank 0 failed inside a step (the step's inputs may be out, the other ranks waiting in
        its collectives for sums rank 0 will never send): the group cannot run another step in
        step, so it ends here as when a rank dies. Returns the error to raise."""
        if self._fail(reason):
            _log.error("tensor_parallel_rank_lost", rank=0, pid=os.getpid(), reason=reason)
            for proc in self._procs:
                if proc.poll() is None:
                    proc.kill()  # a rank waiting in gloo would wait out its timeout
            self._after_failure()
        return TensorParallelError(f"{self.failure}; the executor cannot run steps")

    def join(self, device: torch.device, all_reduce: str = "auto") -> RankGroups:
        """Wait for every rank to have loaded its shard, then form the groups (rank 0)."""
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        for rank in range(1, self.world):
            while not self.store.check([f"loaded/{rank}"]):
                self._raise_if_lost("while loading its shard")
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"tensor-parallel rank {rank} did not load its shard within "
                                              f"{LOAD_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
        self.groups = RankGroups.join(self.store, 0, self.world, device, all_reduce, secret=self._secret)
        return self.groups

    def _raise_if_lost(self, when: str = "") -> None:
        if self.failure is None and any(proc.poll() is not None for proc in self._procs):
            time.sleep(0.1)  # the watcher thread, woken by the same exit, writes the reason
        if self.failure is not None:
            raise TensorParallelError(f"{self.failure}{' ' + when if when else ''}; the executor cannot run steps")

    def run_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 forward: Callable[[], T], kind: int = STEP, logit_rows: list[int] = ()) -> T:
        """Hand the step to the other ranks, then run rank 0's ``forward`` (whose all-reduces
        meet theirs); ``kind`` (collectives.STEP_KINDS): the forward the ranks run it through;
        ``logit_rows``: the hidden rows a vocab-parallel head's shares are computed of."""
        def step() -> T:
            self.groups.send_step(input_ids, positions, meta, kind, logit_rows)
            return forward()
        return self.collective(step)

    def capture(self, run: Callable[[], T]) -> T:
        """Rank 0's ``run()`` (its decode graphs' capture) while every other rank captures its
        own: each graph records the same all-reduces, in the same order."""
        def both() -> T:
            self.groups.send_capture()
            return run()
        return self.collective(both)

    def collective(self, run: Callable[[], T]) -> T:
        """``run()``, whose collectives meet the other ranks': a failure there (a rank gone or
        stuck, or rank 0's own) raises TensorParallelError with the reason."""
        self._raise_if_lost()
        try:
            return run()
        except TensorParallelError:
            raise
        except Exception as exc:
            raise self.step_failed(exc) from exc

    def step_failed(self, exc: Exception) -> TensorParallelError:
        """The error for a step that raised ``exc`` on rank 0: a rank's loss where one is gone
        (a collective fails when a peer dies; its watcher may be a moment behind), else rank 0's
        own failure, which ends the group (``lose``)."""
        deadline = time.monotonic() + PEER_EXIT_WAIT_S
        while self.failure is None and time.monotonic() < deadline:
            if any(proc.poll() is not None for proc in self._procs):
                time.sleep(0.1)  # the watcher thread, woken by the same exit, writes the reason
                break
            time.sleep(0.01)
        if self.failure is not None:
            return TensorParallelError(f"{self.failure}; the executor cannot run steps")
        return self.lose(f"tensor-parallel rank 0 failed inside a step: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Stop the other ranks (they leave their loop on a stop header), killing the slow ones."""
        if self._closing:
            return
        self._closing = True
        if self.groups is not None and self.failure is None:
            try:
                self.groups.send_stop()
            except RuntimeError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        atexit.unregister(self._kill)
        shutil.rmtree(self.store_dir, ignore_errors=True)

    def _kill(self) -> None:
        self._closing = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(self.store_dir, ignore_errors=True)
