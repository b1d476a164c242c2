"""A function of a run in a child process of its own, its result back as JSON.

Some parts of a run must not share the run's process: a client whose event loop must not
also read the run's hundreds of streams (the stress suite's bursts, the flooding tenant),
or a model whose peak memory must be its own (a weight format). ``command`` gives the child's
command line; the child (``python -m benchmarks.harness.child MODULE:FUNCTION JSON``) calls
``FUNCTION(**JSON)`` and prints what it returns as the last line of its stdout, which
``result`` reads back.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

from benchmarks.harness.paths import REPO_ROOT


def command(function: str, **kwargs: Any) -> list[str]:
    """The command line that runs ``function`` ("module:name") with ``kwargs`` (JSON values)."""
    module, _, name = function.partition(":")
    if not module or not name:
        raise ValueError(f"expected MODULE:FUNCTION, got {function!r}")
    return [sys.executable, "-m", "benchmarks.harness.child", function, json.dumps(kwargs)]


CWD = str(REPO_ROOT)
"""The children run from the checkout's root, where ``benchmarks`` is importable."""


def result(stdout: str) -> Any:
    """What the child's function returned (its stdout's last line)."""
    lines = stdout.strip().splitlines()
    if not lines:
        raise RuntimeError("the child process printed no result")
    return json.loads(lines[-1])


def main(argv: list[str]) -> int:
    function, kwargs = argv
    module, _, name = function.partition(":")
    value = getattr(importlib.import_module(module), name)(**json.loads(kwargs))
    print(json.dumps(value), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
