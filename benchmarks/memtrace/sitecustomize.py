"""Memory tracing for one service process of the stress suite (``benchmarks/stress.py --trace-memory DIR``).

Python imports ``sitecustomize`` at start-up from the first directory of PYTHONPATH that has
one; the stress suite puts this directory there only when asked to trace. In the process whose
command line runs ``services.<TOKENMILL_MEMTRACE_SERVICE>`` (the scheduler by default) a daemon
thread appends one JSON line to ``DIR/<service>-<pid>.jsonl`` every TOKENMILL_MEMTRACE_EVERY
seconds (60) and whenever the process gets SIGUSR2; SIGUSR1 first calls glibc's
``malloc_trim(0)`` and then writes the line (tagged ``trim``). Both signals are blocked in
every thread and taken by the tracing thread with ``sigtimedwait``, so no Python signal
handler has to wait for the event loop. A line holds:

- ``status``: VmRSS, RssAnon, RssFile, Threads (KiB / count) from /proc/self/status;
- ``rollup``: /proc/self/smaps_rollup (KiB);
- ``heap_kib``: resident KiB of the ``[heap]`` mapping (glibc's main arena, grown by brk);
  ``anon_kib``: resident KiB of every other anonymous mapping (pymalloc arenas, glibc's
  thread arenas and its mmapped large blocks);
- ``pymalloc``: the totals of ``sys._debugmallocstats()`` (arenas now and at their high-water
  mark, bytes in allocated and in free blocks, empty pools);
- ``mallinfo2``: glibc's totals over all its arenas (arena = bytes taken from the system,
  uordblks = in use, fordblks = free, hblkhd = mmapped large blocks), ``glibc_arenas``: the
  number of glibc malloc arenas (from ``malloc_info``);
- ``objects``: the 25 most numerous types among the objects the cyclic GC tracks outside its
  frozen generation (``<frozen>``: how many are frozen), and ``tasks``: how many asyncio tasks
  exist.

With TOKENMILL_MEMTRACE_TRIM=1 every line asked for by SIGUSR2 is also taken after
``malloc_trim(0)`` (what a service that trims when it goes idle would hold). With
TOKENMILL_MEMTRACE_UNFREEZE=1 (the default) the first line asked for by a signal (the stress
suite's "cold") first calls ``gc.unfreeze()``, so the type counts of later lines include the
objects ``run_service`` froze after start-up and compare like with like (an executor restart
unfreezes them anyway); the cyclic GC then walks them again, which costs time, not memory.

With TOKENMILL_MEMTRACE_TRACEMALLOC=N, tracemalloc starts (N frames a trace) at that first
signal too; the next signal's snapshot is the baseline, and every later signal's line has
``tracemalloc``: the traced total and the 25 tracebacks whose memory grew most since the
baseline. It slows the process's allocations severalfold.

Debug only: it costs one walk of the GC's objects per line, and the walk's temporary list.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter

_SERVICE = os.environ.get("TOKENMILL_MEMTRACE_SERVICE", "scheduler")
_DIR = os.environ.get("TOKENMILL_MEMTRACE_DIR", "")
_EVERY = float(os.environ.get("TOKENMILL_MEMTRACE_EVERY", "60"))
_TRIM = os.environ.get("TOKENMILL_MEMTRACE_TRIM", "0") == "1"
_UNFREEZE = os.environ.get("TOKENMILL_MEMTRACE_UNFREEZE", "1") == "1"
_TRACEMALLOC = int(os.environ.get("TOKENMILL_MEMTRACE_TRACEMALLOC", "0"))


def _kib_fields(path: str) -> dict[str, int]:
    out = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            parts = value.split()
            if " " not in key and parts and parts[0].isdigit():
                out[key.strip()] = int(parts[0])
    return out


def _smaps_split() -> tuple[int, int]:
    """(resident KiB of [heap], resident KiB of the other anonymous mappings)."""
    heap = anon = 0
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                fields = line.split()
                current = fields[5] if len(fields) > 5 else ""
            elif line.startswith("Rss:"):
                kib = int(line.split()[1])
                if current == "[heap]":
                    heap += kib
                elif current == "":
                    anon += kib
    return heap, anon


def _pymalloc() -> dict[str, int]:
    """The totals of sys._debugmallocstats(), which writes to the C stderr: captured through a file."""
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    out = {}
    for line in text.splitlines():
        m = re.match(r"^# (arenas [a-z ]+?|bytes in [a-z ]+?|unused pools|bytes lost to [a-z ]+?)\s*=\s*([\d,]+)", line)
        if m:
            out[m.group(1).replace(" ", "_")] = int(m.group(2).replace(",", ""))
        m = re.match(r"^(\d+) arenas \* (\d+) bytes/arena\s*=\s*([\d,]+)", line)
        if m:
            out["arena_bytes"] = int(m.group(3).replace(",", ""))
    return out


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2
_libc.fopen.restype = ctypes.c_void_p
_libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
_libc.fclose.argtypes = [ctypes.c_void_p]
_libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]


def _glibc() -> dict[str, int]:
    info = _libc.mallinfo2()
    out = {name: int(getattr(info, name)) for name, _ in _Mallinfo2._fields_}
    with tempfile.NamedTemporaryFile(suffix=".xml") as tmp:
        fp = _libc.fopen(tmp.name.encode(), b"w")
        _libc.malloc_info(0, fp)
        _libc.fclose(fp)
        with open(tmp.name) as f:
            out["glibc_arenas"] = len(re.findall(r"<heap nr=", f.read()))
    return out


def _objects() -> tuple[list[tuple[str, int]], int]:
    counts = Counter(type(o).__name__ for o in gc.get_objects())
    if hasattr(gc, "get_freeze_count"):
        counts["<frozen>"] = gc.get_freeze_count()
    return counts.most_common(25), counts.get("Task", 0)


def _line(tag: str) -> dict:
    heap, anon = _smaps_split()
    objects, tasks = _objects()
    return {"t": time.time(), "tag": tag, "status": {k: v for k, v in _kib_fields("/proc/self/status").items()
                                                      if k in ("VmRSS", "RssAnon", "RssFile", "Threads")},
            "rollup": _kib_fields("/proc/self/smaps_rollup"), "heap_kib": heap, "anon_kib": anon,
            "pymalloc": _pymalloc(), "mallinfo2": _glibc(), "objects": objects, "tasks": tasks}


def _trace() -> None:
    path = os.path.join(_DIR, f"{_SERVICE}-{os.getpid()}.jsonl")
    signals = {signal.SIGUSR1, signal.SIGUSR2}
    tag = "start"
    unfrozen = False
    baseline = None
    while True:
        try:
            if tag != "start" and _UNFREEZE and not unfrozen:
                gc.unfreeze()
                unfrozen = True
            just_started = tag != "start" and _TRACEMALLOC and not tracemalloc.is_tracing()
            if just_started:
                tracemalloc.start(_TRACEMALLOC)
            traced = None
            if tag in ("signal", "trim") and tracemalloc.is_tracing() and not just_started:
                snapshot = tracemalloc.take_snapshot().filter_traces(
                    [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)])
                if baseline is None:
                    baseline = snapshot
                else:
                    traced = {"total": tracemalloc.get_traced_memory()[0], "top": [
                        [stat.size_diff, stat.count_diff, [f"{f.filename}:{f.lineno}" for f in stat.traceback]]
                        for stat in snapshot.compare_to(baseline, "traceback")[:25]]}
                del snapshot
            if tag == "trim" or (tag == "signal" and _TRIM):
                before = _kib_fields("/proc/self/status")["VmRSS"]
                _libc.malloc_trim(0)
                record = _line(tag if tag == "signal" else "trim")
                record["rss_before_trim_kib"] = before
            else:
                record = _line(tag)
            if traced is not None:
                record["tracemalloc"] = traced
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except Exception as err:  # a debug aid must never take the service down
            with open(path, "a") as f:
                f.write(json.dumps({"t": time.time(), "error": repr(err)}) + "\n")
        got = signal.sigtimedwait(signals, _EVERY)
        tag = "periodic" if got is None else "trim" if got.si_signo == signal.SIGUSR1 else "signal"


if _DIR and any(arg == f"services.{_SERVICE}" for arg in getattr(sys, "orig_argv", [])):
    # Blocked before any other thread exists, so every thread inherits the mask and only
    # the tracing thread's sigtimedwait takes these signals.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
    threading.Thread(target=_trace, name="tokenmill-memtrace", daemon=True).start()
