"""benchmarks/memtrace: the stress suite's memory tracer, in a real process that it traces."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.common import malloc
from services.common.service_config import REPO_ROOT

pytestmark = pytest.mark.skipif(malloc._LIBC is None or not os.path.exists("/proc/self/smaps"),
                                reason="reads Linux's /proc and glibc's allocator statistics")

TRACED = """
import os, signal, sys, time
def wait_lines(n):
    path = os.path.join(os.environ["TOKENMILL_MEMTRACE_DIR"], f"probe-{os.getpid()}.jsonl")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if os.path.exists(path) and len(open(path).read().splitlines()) >= n:
            return
        time.sleep(0.05)
    sys.exit("the tracer wrote no line")
wait_lines(1)
import gc; gc.freeze()                                       # as run_service does after start-up
os.kill(os.getpid(), signal.SIGUSR2); wait_lines(2)          # baseline: tracemalloc starts
os.kill(os.getpid(), signal.SIGUSR2); wait_lines(3)          # its snapshot is the baseline
kept = [bytearray(1000) for _ in range(3000)]                # 3 MB that stay
os.kill(os.getpid(), signal.SIGUSR2); wait_lines(4)
del kept
os.kill(os.getpid(), signal.SIGUSR1); wait_lines(5)          # malloc_trim, then a line
"""


def test_lines_at_start_on_signals_and_after_trim(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT / 'benchmarks' / 'memtrace'}{os.pathsep}{REPO_ROOT}",
           "TOKENMILL_MEMTRACE_DIR": str(tmp_path), "TOKENMILL_MEMTRACE_SERVICE": "probe",
           "TOKENMILL_MEMTRACE_EVERY": "600", "TOKENMILL_MEMTRACE_TRACEMALLOC": "3"}
    # The tracer starts only in a process whose command line names services.<service>.
    subprocess.run([sys.executable, "-c", TRACED, "services.probe"], env=env, timeout=60, check=True)
    (path,) = tmp_path.iterdir()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["tag"] for line in lines] == ["start", "signal", "signal", "signal", "trim"]
    assert not [line for line in lines if "error" in line]
    for line in lines:
        assert line["status"]["VmRSS"] > 0 and line["status"]["Threads"] >= 2  # the tracer's own thread
        assert line["mallinfo2"]["glibc_arenas"] >= 1 and line["mallinfo2"]["uordblks"] > 0
        assert line["heap_kib"] + line["anon_kib"] <= line["rollup"]["Anonymous"] + 4
    assert lines[0]["pymalloc"]["arenas_allocated_current"] >= 1
    # The 3,000 kept blocks of 1,000 bytes are glibc's (over pymalloc's 512 bytes) and lead the diff.
    grown = lines[3]["mallinfo2"]["uordblks"] - lines[2]["mallinfo2"]["uordblks"]
    assert grown > 2_900_000, grown
    size, count, traceback = lines[3]["tracemalloc"]["top"][0]
    assert size > 2_900_000 and count >= 3000 and traceback[-1].startswith("<string>:")
    assert lines[4]["rss_before_trim_kib"] >= lines[4]["status"]["VmRSS"] - 64
    # The first signal unfroze what the process froze, so later type counts include those objects.
    assert not dict(lines[1]["objects"]).get("<frozen>") and dict(lines[1]["objects"])["function"] > 1000


def test_symbolize_finds_a_stripped_librarys_load_address_from_return_addresses():
    # heaptrack records return addresses less one; the base that puts them right after call
    # instructions is the library's (here: calls at known offsets of an otherwise empty image).
    import importlib.util
    spec = importlib.util.spec_from_file_location("symbolize", REPO_ROOT / "benchmarks" / "memtrace" / "symbolize.py")
    symbolize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(symbolize)
    image = bytearray(256 * 1024)
    returns = [0x1234 + 997 * i for i in range(200)]
    for i, ret in enumerate(returns):
        if i % 2:
            image[ret - 5] = 0xE8                      # call rel32
        else:
            image[ret - 2:ret] = bytes([0xFF, 0xD0])   # call rax
    base = 0x7F65A6E00000
    assert symbolize.load_base(bytes(image), [base + ret - 1 for ret in returns]) == base
