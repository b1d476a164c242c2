"""The size contract: no function or method in services/ (services/tools, the model conversion
and building tools, included), benchmarks/ or scripts/ longer than 60 lines,
and no class of the scheduler process (services/scheduler, services/common) longer than 60.

A long function is where a second job hides; a long class in the scheduler process is where
the request's state starts to spread (SGLang's scheduler grew six mixins that way). Lines are
counted from ``def``/``class`` to the last line of the body, docstring and comments included.

``OVER_LIMIT`` names what was already longer when the contract was written. It only shrinks:
a new name over the limit fails, and so does a listed one that is now within it (take it off
the list, so it cannot grow back unnoticed).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 60
CLASS_ROOTS = ("services/scheduler/", "services/common/")

OVER_LIMIT: frozenset[str] = frozenset({
    "services/scheduler/core/scheduler.py::Scheduler",
    "services/scheduler/engine/core.py::EngineCore",
    "services/scheduler/request/request.py::Request",
})


def _source_files(root: Path) -> list[Path]:
    generated = root / "services" / "common" / "pb"
    files = [path for top in ("services", "benchmarks", "scripts") for path in sorted((root / top).rglob("*.py"))]
    return [f for f in files if not f.is_relative_to(generated)]


def _definitions(tree: ast.AST, prefix: str = ""):
    """(kind, qualified name, lines) of every function and class, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            yield kind, prefix + node.name, node.end_lineno - node.lineno + 1
            yield from _definitions(node, f"{prefix}{node.name}.")
        else:
            yield from _definitions(node, prefix)


@cache
def oversized(root: Path = REPO_ROOT) -> dict[str, int]:
    """{path::qualified.name: lines} of each function, and each scheduler-process class, over MAX_LINES."""
    found = {}
    for path in _source_files(root):
        where = path.relative_to(root).as_posix()
        for kind, name, lines in _definitions(ast.parse(path.read_text(), filename=str(path))):
            if lines > MAX_LINES and (kind == "function" or where.startswith(CLASS_ROOTS)):
                found[f"{where}::{name}"] = lines
    return found


def test_no_new_function_or_scheduler_class_over_the_limit():
    new = {name: lines for name, lines in oversized().items() if name not in OVER_LIMIT}
    assert not new, (f"longer than {MAX_LINES} lines: split along a seam "
                     + ", ".join(f"{name} ({lines})" for name, lines in sorted(new.items())))


def test_the_list_of_old_ones_only_shrinks():
    found = oversized()
    within = sorted(name for name in OVER_LIMIT if name not in found)
    assert not within, f"now within {MAX_LINES} lines or gone: take off OVER_LIMIT {within}"


def test_the_contract_sees_long_functions_and_scheduler_classes(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    nested = "".join(f"        x{i} = {i}\n" for i in range(MAX_LINES))
    files = {
        "services/gateway/long.py": f"def long():\n{body}\ndef short():\n    return 1\n",
        "services/gateway/big_class.py": f"class Big:\n{body}",
        "services/scheduler/big_class.py": f"class Big:\n    async def method(self):\n{nested}",
        "benchmarks/run.py": f"def outer():\n    def inner():\n{nested}",
        "services/tools/convert.py": f"def convert():\n{body}",
        "scripts/gen.py": f"def main():\n{body}",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert sorted(oversized(tmp_path)) == [
        "benchmarks/run.py::outer", "benchmarks/run.py::outer.inner", "scripts/gen.py::main",
        "services/gateway/long.py::long",
        "services/scheduler/big_class.py::Big", "services/scheduler/big_class.py::Big.method",
        "services/tools/convert.py::convert",
    ]
