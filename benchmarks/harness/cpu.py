"""CPU seconds, resident memory and threads of processes, read from /proc.

Wall-clock throughput on a shared machine depends on the other processes; CPU time per
output token depends far less on them (thread spinning under contention still inflates it
somewhat). A system that runs in the benchmark process is covered by its own
process_time(); the services add their processes, read from /proc/PID/stat (user + system
time of all their threads).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_cpu_seconds(stat: str) -> float:
    # After the command name: state is field 3 of stat(5), so utime (14) and stime (15) sit at 11 and 12.
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (all threads); None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return _stat_cpu_seconds(f.read())
    except OSError:
        return None


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (threads of one name summed) of a process."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        name = stat.rsplit(")", 1)[0].split("(", 1)[1]
        out[name] = out.get(name, 0.0) + _stat_cpu_seconds(stat)
    return out


class ProcStatus(NamedTuple):
    rss_kib: int
    threads: int
    cpu_seconds: float
    """User + system CPU seconds used so far."""


def proc_status(pid: int) -> ProcStatus:
    """Resident KiB, threads and CPU seconds of a live process; ProcessLookupError when it is gone."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    except OSError as exc:
        raise ProcessLookupError(f"process {pid} is gone") from exc
    cpu = process_cpu_seconds(pid)
    if cpu is None:
        raise ProcessLookupError(f"process {pid} is gone")
    return ProcStatus(int(fields["VmRSS"].split()[0]), int(fields["Threads"]), cpu)


class CpuMeter:
    """CPU seconds of this process plus the given processes between start() and stop()."""

    def __init__(self, pids: Iterable[int] = ()) -> None:
        self.pids = list(pids)
        self._start: dict[int, float] = {}
        self._self_start = 0.0
        self.seconds: float | None = None
        self.own_seconds: float | None = None
        """This process's share (the benchmark client, for the services)."""
        self.by_pid: dict[int, float] = {}
        """Each other process's share."""

    def _others(self) -> dict[int, float]:
        return {pid: s for pid in self.pids if (s := process_cpu_seconds(pid)) is not None}

    def start(self) -> None:
        self._start = self._others()
        self._self_start = time.process_time()

    def stop(self) -> float:
        others = self._others()
        self.own_seconds = time.process_time() - self._self_start
        self.by_pid = {pid: others[pid] - self._start[pid] for pid in self._start if pid in others}
        self.seconds = self.own_seconds + sum(self.by_pid.values())
        return self.seconds


def core_shares(pids: Mapping[str, int]) -> Callable[[float], str]:
    """Start counting the named processes' CPU; the function returned says each one's CPU since,
    over the wall seconds it is given, as a fraction of one core ("scheduler 0.61, ...")."""
    before = {name: process_cpu_seconds(pid) for name, pid in pids.items()}

    def share(name: str, pid: int, seconds: float) -> str:
        after, start = process_cpu_seconds(pid), before[name]
        return f"{name} {(after - start) / seconds:.2f}" if after is not None and start is not None else f"{name} ?"

    return lambda seconds: ", ".join(share(name, pid, seconds) for name, pid in pids.items())
