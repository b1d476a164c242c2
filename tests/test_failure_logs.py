"""A failed test's report carries the logs of the stacks it ran (tests/helpers/stack_logs.py):
a test run in a child pytest with this suite's conftest writes a service log and starts a
command the way stack helpers do, then fails; its report must show both."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.service_harness import REPO_ROOT

FAILING = '''
from tests.helpers.typed_up import start_up, user_env


def test_a_stack_that_loses_its_executor(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "executor.log").write_text("".join(f"step {i}\\n" for i in range(200)) + "killed: boom\\n")
    up = start_up("echo replica-0 restarting >&2", user_env())
    up.process.wait()
    assert False, "the client saw a 503"


def test_a_passing_neighbour():
    pass


def test_a_second_failure_of_the_module():
    assert False, "the next request saw a 503 too"
'''


def test_a_failed_report_shows_the_tail_of_each_service_log_and_the_up_output(tmp_path):
    (tmp_path / "test_failing.py").write_text(FAILING)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "base"), str(tmp_path)],
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True,
                         text=True, timeout=120)
    out = run.stdout
    assert run.returncode == 1 and "2 failed, 1 passed" in out, out
    assert "service log" in out and "executor.log" in out and "killed: boom" in out, out
    assert "step 199" in out and "step 0\n" not in out and "lines before" in out, out  # the tail, not all of it
    assert "output of `echo replica-0 restarting >&2`" in out and "replica-0 restarting" in out, out
    assert out.count("executor.log -") == 1, out  # the second failure does not repeat unchanged logs
