"""make test's background build of llama-cpp-python: the tests that need it run last and wait for it."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tests.conftest import pytest_collection_modifyitems
from tests.helpers.llama_cpp_build import wait_for_exit


def test_the_wait_returns_when_the_build_process_ends_and_fails_while_it_runs():
    # started by another process (as make's background build is to pytest): a grandchild
    build = subprocess.run([sys.executable, "-c", "import subprocess as s, sys; print(s.Popen("
                            "[sys.executable, '-c', 'import time; time.sleep(3)'], "
                            "stdout=s.DEVNULL, stderr=s.DEVNULL).pid)"],
                           capture_output=True, text=True, check=True)
    pid = int(build.stdout)
    with pytest.raises(AssertionError, match="still runs after"):
        wait_for_exit(pid, wait_s=0.2, poll_s=0.05)
    began = time.monotonic()
    wait_for_exit(pid, wait_s=30, poll_s=0.05)
    assert time.monotonic() - began > 0.5  # it did wait for the process, then returned


def test_tests_waiting_on_background_builds_are_ordered_last_and_the_rest_keep_their_order():
    def item(name, marker=None):
        return SimpleNamespace(name=name, keywords={},
                               get_closest_marker=lambda mark: object() if mark == marker else None)

    items = [item("a"), item("up1", "llama_cpp"), item("avx2", "background_build"), item("b"),
             item("up2", "llama_cpp"), item("c")]
    pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == ["a", "b", "c", "up1", "avx2", "up2"]
