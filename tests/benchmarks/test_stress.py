"""benchmarks/stress.py's pieces that need no stack: /proc readings and the scheduler's environment."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from benchmarks.stress import StressLauncher, proc_status
from services.stack.launcher import LaunchConfig, ServiceProcess


def test_proc_status_reads_rss_threads_and_cpu():
    sum(range(2_000_000))  # some CPU time of our own
    rss, threads, cpu = proc_status(os.getpid())
    assert rss > 1000 and threads >= 1 and cpu > 0


def test_scheduler_env_prefixes_only_the_scheduler():
    launcher = StressLauncher(LaunchConfig(model="m"), scheduler_env={"PYTHONMALLOC": "malloc"})
    try:
        for name in ("tokenizer", "executor", "drafter"):
            launcher.services[name] = ServiceProcess(name, [], 1234, Path("/nonexistent"), None)
        scheduler = launcher._command("scheduler", 5678)
        assert scheduler[:2] == ["env", "PYTHONMALLOC=malloc"] and "services.scheduler" in scheduler
        assert launcher._command("tokenizer", 1234)[0] != "env"
    finally:
        shutil.rmtree(launcher._state_dir, ignore_errors=True)
