"""services/common/gc_thresholds.py: the flag reaches the collector, 0 keeps Python's thresholds."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from services.common.gc_thresholds import GC_OLDER_THRESHOLD, GC_YOUNG_THRESHOLD, set_gc_thresholds
from services.common.service_config import REPO_ROOT


@pytest.fixture(autouse=True)
def restore_thresholds():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_a_young_threshold_sets_all_three_generations() -> None:
    set_gc_thresholds(1234)
    assert gc.get_threshold() == (1234, GC_OLDER_THRESHOLD, GC_OLDER_THRESHOLD)
    set_gc_thresholds()
    assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, GC_OLDER_THRESHOLD, GC_OLDER_THRESHOLD)


def test_zero_leaves_the_thresholds_as_they_are() -> None:
    gc.set_threshold(700, 10, 10)
    set_gc_thresholds(0)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_negative_threshold_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"gc_young_threshold must be >= 0 \(0 = Python's defaults\), got -5"):
        set_gc_thresholds(-5)


SERVICE_THRESHOLDS = """
import gc, sys
from services.common import service_main
print(gc.get_threshold())
seen = []
service_main.run_service = lambda main, grace: seen.append(gc.get_threshold())
from services.tokenizer.main import main
assert main(sys.argv[1:]) == 0, "the service did not start"
print(seen[0])
"""


@pytest.mark.parametrize(("argv", "expected"), [
    ([], (GC_YOUNG_THRESHOLD, GC_OLDER_THRESHOLD, GC_OLDER_THRESHOLD)),
    (["--gc-young-threshold", "5000"], (5000, GC_OLDER_THRESHOLD, GC_OLDER_THRESHOLD)),
    (["--gc-young-threshold", "0"], None),
])
def test_a_service_process_runs_with_the_flags_thresholds(argv, expected) -> None:
    # A fresh interpreter, as a service process starts: what the collector holds when the
    # server would start. None: Python's own, as the interpreter started.
    result = subprocess.run([sys.executable, "-c", SERVICE_THRESHOLDS, "--allow-unauthenticated", *argv], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    python_defaults, at_start = result.stdout.strip().splitlines()[-2:]
    assert at_start == str(expected or python_defaults)
