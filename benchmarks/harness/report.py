"""The result file of a run: its figures with the command, commit, machine and load that produced them.

Every run writes one JSON file under benchmarks/results/ (``write_result``): the figures
the run computed, and beside them ``command`` (how to run it again), ``git`` (the commit
and whether tracked files differed from it), ``machine`` and ``load_average`` (the
1-minute load before and after: a figure measured on a shared machine says how shared).
Standard library only: the GPU check imports it where the services' dependencies are absent.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import paths
from benchmarks.harness.paths import REPO_ROOT

PROG = "python -m benchmarks"


def command_line(prog: str, argv: Sequence[str]) -> str:
    return f"{prog} {shlex.join(argv)}".rstrip()


def git_revision(repo: Path = REPO_ROOT) -> dict:
    """The commit the run measured (full and short), and the tracked files that differed from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False).stdout

    commit = git("rev-parse", "HEAD").strip() or None
    changed = git("status", "--porcelain", "--untracked-files=no").splitlines()  # "XY path": path from column 3
    return {"commit": commit, "short": commit[:7] if commit else None, "dirty": bool(changed),
            "tracked_files_changed": [line[3:] for line in changed]}


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float:
    """The 1-minute load average (NaN where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def machine_info() -> dict:
    """The CPU, the Python, and torch's and transformers' versions and threads where this run loaded them."""
    info = {
        "cpu": cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info |= {"torch_version": torch.__version__, "torch_threads": torch.get_num_threads()}
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        info["transformers_version"] = transformers.__version__
    if hasattr(os, "getloadavg"):
        info["load_average_at_end"] = list(os.getloadavg())
    return info


class LoadWatch:
    """The 1-minute load average when a run started and when it ended."""

    def __init__(self) -> None:
        self.before = load_average()
        self.after: float | None = None

    def stop(self) -> list[float]:
        self.after = load_average()
        return [self.before, self.after]


def result_path(kind: str, path: Path | str | None = None, out_dir: Path | None = None,
                name: str | None = None) -> Path:
    """``path`` when given, else ``out_dir`` (benchmarks/results) / ``name`` or KIND-DATE-TIME, .json."""
    if path:
        return Path(path)
    stem = name or f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    return (out_dir or paths.RESULTS_DIR) / f"{stem}.json"  # read now: tests redirect it


def provenance(command: str, load: LoadWatch | None = None) -> dict:
    """What every result file carries beside its figures."""
    out = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "command": command,
           "git": git_revision(), "machine": machine_info()}
    if load is not None:
        out["load_average"] = [load.before, load.after if load.after is not None else load_average()]
    return out


def write_result(result: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
