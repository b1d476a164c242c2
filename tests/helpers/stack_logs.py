"""What the processes of a failing test's stacks wrote, shown in its failure report.

A stack test fails on what a client sees (a 503, a lost stream); why is in the services' logs,
which are gone with the run's temporary directories. tests/conftest.py appends to every failed
report the tail of each ``*.log`` written since the test's module began, under pytest's
temporary root (where stack fixtures put their log directories) and under the repository's
``.tokenmill/logs`` (`tokenmill up`'s default), and the output of each `tokenmill up` that a
helper started since then (``remember``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.helpers.service_harness import REPO_ROOT

TAIL_LINES = 80
"""Lines shown of each log (the end: where a process says why it stopped)."""
MAX_LOGS = 24
"""Logs shown at most (the newest), so one report stays readable."""

_outputs: list[tuple[float, str, Callable[[], str]]] = []
_shown: set[tuple[str, int]] = set()
"""Sections already in a report: the next failure of a module (each test of a failed fixture) shows
only what changed."""


def remember(name: str, output: Callable[[], str]) -> None:
    """Show ``output()`` (a started process's output so far) in reports of tests that fail from now on."""
    _outputs.append((time.time(), name, output))


def _tail(text: str) -> str:
    lines = text.splitlines()
    cut = len(lines) - TAIL_LINES
    return "\n".join(([f"... ({cut} lines before)"] if cut > 0 else []) + lines[-TAIL_LINES:])


def _logs(roots: list[Path], since: float) -> list[Path]:
    found = []
    for root in roots:
        if root.is_dir():
            for path in root.rglob("*.log"):
                try:
                    if path.is_file() and path.stat().st_mtime >= since:
                        found.append(path)
                except OSError:  # removed while we looked
                    continue
    found.sort(key=lambda path: path.stat().st_mtime if path.exists() else 0.0)
    return found[-MAX_LOGS:]


def sections(temp_root: Path | None, since: float) -> Iterator[tuple[str, str]]:
    """(title, tail) for each log and remembered output written since ``since`` (epoch seconds),
    leaving out those already shown in an earlier report unchanged."""
    for title, text in _sections(temp_root, since):
        if (title, hash(text)) not in _shown:
            _shown.add((title, hash(text)))
            yield title, text


def _sections(temp_root: Path | None, since: float) -> Iterator[tuple[str, str]]:
    del _outputs[:-MAX_LOGS]
    for started, name, output in _outputs:
        if started >= since:
            yield f"output of {name}", _tail(output())
    roots = [REPO_ROOT / ".tokenmill" / "logs"] + ([temp_root] if temp_root is not None else [])
    for path in _logs(roots, since):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        yield f"service log {path}", _tail(text)
