"""The stress suite's pieces that need no stack: /proc readings, the scheduler's environment, its
flags, and the burst client process (against a bare server that only refuses)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.harness import flags
from benchmarks.harness.bursts import FLOOR_SERVER
from benchmarks.harness.cpu import proc_status
from benchmarks.stress import (KILL_AFTER_ROUND_START_S, StressLauncher, StressSettings, Tally, kill_placement, main,
                               overload_bursts)
from services.stack.launcher import LaunchConfig, ServiceProcess


def test_proc_status_reads_rss_threads_and_cpu():
    sum(range(2_000_000))  # some CPU time of our own
    rss, threads, cpu = proc_status(os.getpid())
    assert rss > 1000 and threads >= 1 and cpu > 0


def test_the_executor_kill_lands_while_streams_run():
    # Half-way through two rounds of 300 s is round 2's first instant, when its streams have
    # only just been sent: the kill moves into that round, so in-flight streams meet it.
    assert kill_placement(600, 2, 0.5) == (1, KILL_AFTER_ROUND_START_S)
    assert kill_placement(600, 1, 0.5) == (0, 300.0)
    assert kill_placement(600, 4, 0.6) == (2, 60.0)
    assert kill_placement(600, 2, 0.0) == (0, KILL_AFTER_ROUND_START_S)
    assert kill_placement(600, 2, 1.0) == (1, 300.0)  # the very end stays at the end of the last round
    assert kill_placement(6, 2, 0.5) == (1, 1.5)  # short rounds: half a round in at most
    assert kill_placement(600, 2, -1) == (-1, 0.0)


def test_the_stack_it_launches_and_bad_flags(capsys):
    launch = StressSettings(streams=10).launch()
    assert launch.scheduler_args == ("--max-num-seqs", "128", "--max-waiting-requests", "5")
    assert launch.executor_args == ("--dtype", "fp32", "--device", "cpu", "--num-blocks", "1024")
    assert launch.restart and launch.threads == 1
    parsed = flags.parse(StressSettings, ["--scheduler-env", "A=1,2", "--scheduler-env", "B=3"], prog="stress")
    assert parsed.scheduler_env == ("A=1,2", "B=3")  # one variable a flag: values may hold commas
    traced = StressSettings(trace_memory="/tmp/trace").launch()
    assert traced.python_path.endswith("benchmarks/memtrace") and dict(traced.env)["TOKENMILL_MEMTRACE_SERVICE"]
    for argv, message in ((["--rounds", "0"], "--rounds must be at least 1, got 0"),
                          (["--burst-client", "thread"], "--burst-client: unknown thread"),
                          (["--scheduler-env", "PYTHONMALLOC"], "--scheduler-env: expected NAME=VALUE")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_scheduler_env_prefixes_only_the_scheduler():
    launcher = StressLauncher(LaunchConfig(model="m"), scheduler_env={"PYTHONMALLOC": "malloc"})
    try:
        for name in ("tokenizer", "executor", "drafter", "scheduler"):
            launcher.services[name] = ServiceProcess(name, [], 1234, Path("/nonexistent"), None)
        scheduler = launcher.command("scheduler", 5678)
        assert scheduler[:2] == ["env", "PYTHONMALLOC=malloc"] and "services.scheduler" in scheduler
        assert launcher.command("tokenizer", 1234)[0] != "env"
    finally:
        shutil.rmtree(launcher._state_dir, ignore_errors=True)


async def test_the_burst_client_process_reports_every_refusal():
    server = subprocess.Popen([sys.executable, "-c", FLOOR_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{int(server.stdout.readline())}"
        tally = Tally()
        await overload_bursts(None, address, 7, 0.5, time.monotonic() + 6.0, tally, in_process=False)
    finally:
        server.kill()
        server.wait()
    refused = tally.overload.refused_ms
    assert not tally.crashes and refused and len(refused) % 7 == 0, (tally.crashes, len(refused))
    assert tally.overload.admitted == 0 and tally.overload.without_pushback == 0
    assert all(ms > 0 for ms in refused)
    assert len(tally.overload.bursts) == len(refused) // 7  # each burst: when it was sent, its slowest refusal
    assert all(slowest in refused for _, slowest in tally.overload.bursts)
