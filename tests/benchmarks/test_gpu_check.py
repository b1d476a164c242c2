"""``python -m benchmarks gpu`` runs once on a GPU machine with no second chance, so every path of
its end-to-end and services sections runs here first, on tiny shapes (--dry-run)."""

from __future__ import annotations

import subprocess
import sys

from services.common.service_config import REPO_ROOT


def test_dry_run_of_the_model_runner_and_services_sections(tmp_path):
    out = tmp_path / "gpu_check.md"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "gpu", "--dry-run", "--sections", "e2e,services", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = out.read_text()
    assert "section failed" not in report, report
    assert "commit " in report.splitlines()[2] and "`python -m benchmarks gpu --dry-run" in report
    for row in ("| torch | 2 |", "| triton eager | 2 |", "first burst of 2 after SERVING: TTFT p99",
                "warm burst of 2: TTFT p99", "| 1 stream: TPOT |", "| 2 streams: TPOT |"):
        assert row in report, f"{row!r} missing from the report:\n{report}"
