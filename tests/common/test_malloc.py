"""services/common/malloc.py in fresh interpreters: the arena cap holds for new threads, trim gives pages back."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from services.common import malloc
from services.common.service_config import REPO_ROOT

pytestmark = pytest.mark.skipif(malloc._LIBC is None, reason="glibc's malloc_trim/mallopt are not available")

COUNT_ARENAS = """
import ctypes, re, sys, tempfile, threading
from services.common import malloc
if sys.argv[1] != "none":
    assert malloc.cap_arenas(int(sys.argv[1]))
def work():
    keep = [bytearray(600) for _ in range(2000)]  # over pymalloc's 512 bytes: glibc's malloc
    barrier.wait()
barrier = threading.Barrier(6)
threads = [threading.Thread(target=work) for _ in range(5)]
for t in threads: t.start()
barrier.wait()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.fclose.argtypes = [ctypes.c_void_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
with tempfile.NamedTemporaryFile() as tmp:
    fp = libc.fopen(tmp.name.encode(), b"w"); libc.malloc_info(0, fp); libc.fclose(fp)
    print(len(re.findall("<heap nr=", open(tmp.name).read())))
for t in threads: t.join()
"""

TRIM = """
from services.common import malloc
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
blocks = [bytes(1000) for _ in range(60_000)]  # ~60 MB of malloc'd blocks
keep = blocks[::64]  # one live block every 64 KiB: free() cannot give the pages between back
del blocks
before = rss()
released = malloc.trim()
print(released, before - rss())
"""


def _run(code: str, *args: str, env: dict | None = None) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    environment.update(PYTHONPATH=str(REPO_ROOT), **(env or {}))
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60,
                          env=environment, check=True)
    return done.stdout.strip()


def test_capped_arenas_hold_for_new_threads():
    assert int(_run(COUNT_ARENAS, "none")) > 2  # glibc's default: an arena per new thread
    assert int(_run(COUNT_ARENAS, "2")) == 2


def test_the_environment_variable_wins():
    # MALLOC_ARENA_MAX set by whoever starts the process is theirs to decide: cap_arenas leaves it.
    code = "from services.common import malloc; print(malloc.cap_arenas(2))"
    assert _run(code, env={"MALLOC_ARENA_MAX": "4"}) == "False"


def test_trim_gives_free_pages_back():
    released, kib = _run(TRIM).split()
    assert released == "True"
    assert int(kib) > 20_000, kib  # most of the ~60 MB freed between the kept blocks


def test_bad_arena_limit():
    with pytest.raises(ValueError, match="arena limit"):
        malloc.cap_arenas(0)


async def test_trim_when_idle_trims_once_per_idle_spell(monkeypatch):
    # What progress() returns at the start and at each poll: idle from the start (nothing
    # allocated since to give back), under load, idle (one trim, not one per poll), load, idle.
    readings = iter([0, 0, 0, 1, 2, 3, 3, 3, 3, 4, 4])
    seen = [0]
    done = asyncio.Event()

    def progress():
        value = next(readings, None)
        if value is None:
            done.set()
            value = seen[-1]
        seen.append(value)
        return value

    trims = []
    monkeypatch.setattr(malloc, "trim", lambda: trims.append(seen[-1]) or True)
    task = asyncio.create_task(malloc.trim_when_idle(progress, every_s=0))
    await done.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert trims == [3, 4]

