"""CPU seconds a system used, so its efficiency can be read apart from what else the machine ran.

Wall-clock throughput on a shared machine depends on the other processes; CPU time per
output token depends far less on them (thread spinning under contention still inflates it
somewhat). The in-process engine and the HF baselines run in this process, so its own
process_time() covers them. The services add the four service processes, read from
/proc/PID/stat (user + system time of all their threads); the client in this process counts too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (all threads); None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the command name: state is field 3 of stat(5), so utime (14) and stime (15) sit at 11 and 12.
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


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
