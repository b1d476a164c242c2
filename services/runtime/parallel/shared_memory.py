"""The all-reduce of a CPU tensor-parallel group through one shared memory segment.

Every rank of a CPU tensor-parallel executor is a process of one host, so the row-parallel
layers' partial outputs are summed through a segment they all map
(services/runtime/kernels/cpu/shm_all_reduce.h: a copy in, a wait on a sequence number, a sum
in rank order out) instead of gloo's round trips over loopback sockets (docs/benchmarks.md,
"Tensor parallelism on a CPU", has both measured). The sum is bit-identical on every rank and
from run to run: each adds the same buffers in the same order.

Rank 0 creates the segment's file (in /dev/shm, where there is one) and names it in the
group's store; the others open it; once every rank has mapped it (``min_int`` on the step
channel is the barrier, and the vote on whether all could), rank 0 unlinks the file, so
nothing is left behind however a rank ends. A wait that fails (a peer gone, the leader's
``abort`` after it saw a rank die, or ``timeout_s``) raises RuntimeError with the reason.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable

import structlog
import torch
import torch.distributed as dist

from services.runtime.kernels import cpu as cpu_kernels

_log = structlog.get_logger("tokenmill.parallel")

CAPACITY = 1 << 18
"""Floats a rank's buffer holds (1 MiB): a longer tensor goes in chunks of this. The segment is
2 x world of them (two sets, taken in turn)."""
SPIN_US = 20.0
"""A wait spins this long first: between two all-reduces of a balanced step the ranks arrive
within microseconds of each other."""
YIELD_US = 200.0
"""Then yields the core until this long, then sleeps on a futex (1 ms slices): a long wait on
a machine whose cores are shared gives the core back instead of taking it from the peer."""
_PATH_KEY = "shm_all_reduce/path"


def _segment_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class SharedMemoryReducer:
    """One rank's handle on the group's segment (``join`` makes it)."""

    def __init__(self, handle) -> None:
        self.handle = handle
        """The C++ ShmAllReduce, which the fused CPU step calls directly."""

    @classmethod
    def join(cls, store: dist.Store, rank: int, world: int, vote: Callable[[int], int], timeout_s: float,
             required: bool) -> SharedMemoryReducer | None:
        """The segment every rank has mapped, or None (gloo then) where some rank could not map
        it (``required``: raise instead). ``vote(ok)`` is the group's minimum of ``ok``."""
        handle, reason = None, ""
        path = ""
        try:
            cpu_kernels.load()
            if rank == 0:
                path = os.path.join(_segment_dir(), f"tokenmill-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
                handle = cls._open(path, rank, world, timeout_s)
            else:
                path = store.get(_PATH_KEY).decode()
                if path:
                    handle = cls._open(path, rank, world, timeout_s)
                else:
                    reason = "rank 0 could not create the segment"
        except (cpu_kernels.CpuKernelsUnavailable, RuntimeError) as exc:
            reason = str(exc)
        finally:
            if rank == 0:
                store.set(_PATH_KEY, path if handle is not None else "")
        try:
            agreed = vote(int(handle is not None))  # every rank has mapped it once this returns
        finally:
            if rank == 0 and handle is not None:
                os.unlink(path)
        if agreed:
            return cls(handle)
        message = f"the shared-memory all-reduce is unavailable on rank {rank}: {reason or 'another rank failed'}"
        if required:
            raise RuntimeError(message)
        _log.warning("tensor_parallel_all_reduce", backend="gloo", reason=message)
        return None

    @staticmethod
    def _open(path: str, rank: int, world: int, timeout_s: float):
        return torch.classes.tokenmill_cpu.ShmAllReduce(path, rank, world, CAPACITY, float(timeout_s), SPIN_US,
                                                        YIELD_US)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` (fp32, contiguous, on the CPU) in place over the ranks."""
        if self.handle.all_reduce(tensor) != 0:
            raise RuntimeError(self.handle.last_error())

    def gather(self, local: torch.Tensor, out: torch.Tensor | None) -> None:
        """Rank 0: ``out`` [world, *local.shape] = every rank's ``local``; the others send only."""
        if self.handle.gather_to_first(local, out if out is not None else torch.empty(0)) != 0:
            raise RuntimeError(self.handle.last_error())

    def broadcast(self, tensor: torch.Tensor, idle: bool = False) -> None:
        """Rank 0's ``tensor`` (contiguous, on the CPU, any dtype) into every rank's, in place;
        ``idle``: the other ranks wait for rank 0 without a deadline (its death still ends it)."""
        if self.handle.broadcast_from_first(tensor, idle) != 0:
            raise RuntimeError(self.handle.last_error())

    def all_to_all(self, send: torch.Tensor, send_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``send`` (contiguous, on the CPU, any dtype), ``send_counts[r]`` of them in
        turn to rank r -> (the rows every rank sent this one, by source rank; how many from each)."""
        recv_counts = torch.empty(send_counts.numel(), dtype=torch.int64)
        status, received = self.handle.all_to_all(send, send_counts, recv_counts)
        if status != 0:
            raise RuntimeError(self.handle.last_error())
        return received, recv_counts

    def check(self) -> None:
        """Raise the failure of an all-reduce made from C++ (the fused step), if one failed."""
        if self.handle.status() != 0:
            raise RuntimeError(self.handle.last_error())

    def abort(self) -> None:
        """Fail every rank's waits, now and later (a rank is gone)."""
        self.handle.abort()

    @property
    def seconds(self) -> float:
        """Time this rank has spent in the segment's collectives (waiting for the others included)."""
        return self.handle.seconds()
