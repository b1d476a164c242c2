"""The layering contract: which part of the code may import which.

    cli, benchmarks                      entry points and measurement: may import anything below
    benchmarks.harness                   what every benchmark run shares: anything below, no run
    inprocess, stack, tools              engine in one process; launching and calling a stack;
                                         model conversion and building
    gateway                              OpenAI HTTP + routed Generation API, a client of the
                                         engines' public API only
    scheduler | tokenizer | executor | drafter
                                         the four services: never import each other
    runtime                              model, kernels, sampler, KV layout (torch): executor, drafter
    common                               the torch-free contract and service plumbing

Imports point down, never up or sideways between services, nor between benchmark runs: a run
(benchmarks/NAME.py, a package benchmarks/NAME/ or benchmarks/micro/NAME.py) imports the
harness and its own modules, never another run's; what two runs share belongs in the harness.
The processes that run no model
(scheduler, tokenizer) and everything they import stay torch-free: the second test imports
them in a fresh interpreter and looks for torch in sys.modules.

Every import counts, including those inside functions: a lazy import is still an arrow.

Nor do arrows go round in a circle, between components or inside one: a module that imports,
however indirectly, a module that imports it (under TYPE_CHECKING or inside a function too) has
two jobs that belong apart, or a leaf that belongs below both.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

ALLOWED: dict[str, set[str]] = {
    "common": {"common"},
    "runtime": {"common", "runtime"},
    "tokenizer": {"common", "tokenizer"},
    "scheduler": {"common", "scheduler"},
    "executor": {"common", "runtime", "executor"},
    "drafter": {"common", "runtime", "drafter"},
    "tools": {"common", "runtime", "tools"},
    "stack": {"common", "stack"},
    "gateway": {"common", "gateway"},
    "inprocess": {"common", "runtime", "scheduler", "tokenizer", "executor", "drafter", "inprocess"},
    "cli": {"common", "runtime", "tools", "scheduler", "tokenizer", "executor", "drafter", "stack", "inprocess",
            "gateway", "cli"},
    "harness": {"common", "runtime", "tools", "scheduler", "tokenizer", "executor", "drafter", "stack", "inprocess",
                "gateway", "harness"},
    "benchmarks": {"common", "runtime", "tools", "scheduler", "tokenizer", "executor", "drafter", "stack",
                   "inprocess", "gateway", "harness", "benchmarks"},
}
TORCH_FREE = {"common", "tokenizer", "scheduler", "stack", "gateway"}
TORCH_MODULES = {"torch", "triton"}


def component(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "benchmarks":
        return "harness" if parts[1:2] == ["harness"] else "benchmarks"
    if parts[0] == "services" and len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    return None


def benchmark_run(module: str) -> str:
    """The run a benchmarks module belongs to: benchmarks.NAME, or benchmarks.micro.NAME
    ("benchmarks" itself for the package and its dispatcher)."""
    parts = module.split(".")
    if parts[1:2] in (["__main__"], []):
        return "benchmarks"
    return ".".join(parts[:3] if parts[1] == "micro" and len(parts) > 2 else parts[:2])


def module_name(path: Path, root: Path = REPO_ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def source_files(root: Path = REPO_ROOT) -> list[Path]:
    files = sorted((root / "services").rglob("*.py")) + sorted((root / "benchmarks").rglob("*.py"))
    generated = root / "services" / "common" / "pb"
    return [f for f in files if not f.is_relative_to(generated) and f != root / "services" / "__init__.py"]


def layering_violations(root: Path = REPO_ROOT) -> list[str]:
    violations = []
    for path in source_files(root):
        where_file = path.relative_to(root)
        module = module_name(path, root)
        source = component(module)
        if source is None:
            violations.append(f"{where_file} belongs to no layer: add it to the contract")
            continue
        for line, target in imported_modules(path, module):
            where = f"{where_file}:{line} imports {target}"
            if source in TORCH_FREE and target.split(".")[0] in TORCH_MODULES:
                violations.append(f"{where} (a torch-free part)")
            dest = component(target)
            if dest is not None and dest not in ALLOWED[source]:
                violations.append(f"{where} ({source} may import only {', '.join(sorted(ALLOWED[source]))})")
            elif source == dest == "benchmarks" and benchmark_run(target) not in (benchmark_run(module), "benchmarks"):
                violations.append(f"{where} (another benchmark run: what runs share belongs in benchmarks/harness)")
    return violations


def import_graph(root: Path = REPO_ROOT) -> dict[str, dict[str, int]]:
    """{module: {imported module of services/ or benchmarks/: line}} over every import a module
    makes. ``from package import name`` points at package.name where that is a module, else at
    the package; a package's own __init__ is not counted as imported by importing its modules
    (a package that re-exports its modules would otherwise circle with each of them)."""
    modules = {module_name(path, root): path for path in source_files(root)}
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        arrows: dict[str, int] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else [])
                name = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{name}.{alias.name}" if f"{name}.{alias.name}" in modules else name
                           for alias in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != module:
                    arrows.setdefault(target, node.lineno)
        graph[module] = arrows
    return graph


def import_cycles(root: Path = REPO_ROOT) -> list[str]:
    """One circle per strongly connected group of modules, written ``a:line -> b:line -> a``."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [_one_circle(graph, group) for group in groups]


def _one_circle(graph: dict[str, dict[str, int]], group: list[str]) -> str:
    """The shortest way from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while start not in came_from:  # breadth first; the group is strongly connected, so it ends
        reached = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target in members and target not in came_from:
                    came_from[target] = module
                    reached.append(target)
        frontier = reached
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(came_from[path[-1]])
    path.reverse()
    return " -> ".join(f"{a}:{graph[a][b]}" for a, b in zip(path, path[1:])) + f" -> {start}"


def test_no_import_circle():
    cycles = import_cycles()
    assert not cycles, "modules importing each other (each arrow at the line it is made):\n" + "\n".join(cycles)


def write_tree(root: Path, files: dict[str, str]) -> None:
    """A made-up repository for the checkers' own tests: path -> text."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_circle_finder_sees_lazy_type_checking_and_package_circles(tmp_path):
    files = {
        "services/executor/config.py": "from services.executor.paths import fused\n",
        "services/executor/paths/__init__.py": "",
        "services/executor/paths/fused.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                             "    from ..config import ExecutorConfig\n"),
        "services/drafter/config.py": "def proposer():\n    from services.drafter import model\n",
        "services/drafter/model.py": "from services.drafter.config import settings\n",
        "services/gateway/one.py": "from services.gateway import two\n",
        "services/gateway/two.py": "from services.common import errors\n",
        "services/common/errors.py": "",
    }
    write_tree(tmp_path, files)
    assert import_cycles(tmp_path) == [
        "services.drafter.config:2 -> services.drafter.model:1 -> services.drafter.config",
        "services.executor.config:1 -> services.executor.paths.fused:3 -> services.executor.config",
    ]


def test_imports_point_down_the_layers():
    violations = layering_violations()
    assert not violations, "layering contract broken:\n" + "\n".join(violations)


SCHEDULER_LAYERS: dict[str, set[str]] = {
    "request": {"request"},
    "core": {"request", "core"},
    "engine": {"request", "core", "engine"},
}
"""Inside the scheduler process: a request's state, the scheduling policy over it, the engine
loop over both. None of them imports the service around them (links, supervisor, servicer),
so the in-process engine runs the same loop without a line of gRPC."""


def scheduler_layer_violations(root: Path = REPO_ROOT) -> list[str]:
    violations = []
    for path in sorted((root / "services" / "scheduler").rglob("*.py")):
        module = module_name(path, root)
        parts = module.split(".")
        layer = parts[2] if len(parts) > 2 else None
        if layer not in SCHEDULER_LAYERS:
            continue
        for line, target in imported_modules(path, module):
            target_parts = target.split(".")
            if target_parts[:2] != ["services", "scheduler"]:
                continue
            dest = target_parts[2] if len(target_parts) > 2 else ""
            if dest not in SCHEDULER_LAYERS[layer]:
                violations.append(f"{path.relative_to(root)}:{line} imports {target} (scheduler.{layer} may "
                                  f"import only {', '.join(sorted(SCHEDULER_LAYERS[layer]))})")
    return violations


def test_scheduler_layers_point_down():
    violations = scheduler_layer_violations()
    assert not violations, "scheduler layering broken:\n" + "\n".join(violations)


def test_the_scheduler_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "services" / "scheduler" / "core" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from services.scheduler.engine.core import EngineCore\nfrom services.scheduler.request import x\n")
    assert [v.split(" (")[0] for v in scheduler_layer_violations(tmp_path)] == [
        "services/scheduler/core/bad.py:1 imports services.scheduler.engine.core"]


def test_the_checker_sees_upward_sideways_lazy_and_torch_imports(tmp_path):
    files = {
        "services/scheduler/bad_sideways.py": "from services.executor.model_runner import ModelRunner\n",
        "services/common/bad_up.py": "def f():\n    import services.scheduler.supervisor\n",
        "services/tokenizer/bad_torch.py": "import torch\n",
        "services/executor/fine.py": "from services.runtime.model import llama\nfrom ..common import step\n",
        "services/runtime/bad_relative.py": "from ..executor import model_runner\n",
        "benchmarks/harness/bad_up.py": "from benchmarks.serving import driver\n",
        "benchmarks/stress.py": "from benchmarks.overload import percentile\nfrom benchmarks.harness import stats\n",
        "benchmarks/micro/one.py": "from benchmarks.micro.two import x\n",
        "benchmarks/serving/driver.py": "from benchmarks.serving import presets\n",
    }
    write_tree(tmp_path, files)
    found = layering_violations(tmp_path)
    assert [v.split(" (")[0] for v in found] == [
        "services/common/bad_up.py:2 imports services.scheduler.supervisor",
        "services/runtime/bad_relative.py:1 imports services.executor",
        "services/scheduler/bad_sideways.py:1 imports services.executor.model_runner",
        "services/tokenizer/bad_torch.py:1 imports torch",
        "benchmarks/harness/bad_up.py:1 imports benchmarks.serving",
        "benchmarks/micro/one.py:1 imports benchmarks.micro.two",
        "benchmarks/stress.py:1 imports benchmarks.overload",
    ]


@pytest.mark.parametrize("modules", [
    ["services.scheduler.main", "services.scheduler.supervisor", "services.scheduler.servicer"],
    ["services.tokenizer.main", "services.tokenizer.servicer"],
    ["services.common.codec.step_codec", "services.common.step", "services.common.server", "services.common.detokenize"],
    ["services.stack.launcher", "services.stack.client"],
    ["services.gateway.main", "benchmarks.gateway.simulator.main"],
    # the harness's parts a run on the services uses: its client process stays torch-free
    ["benchmarks.harness.launch", "benchmarks.harness.client", "benchmarks.harness.bursts", "benchmarks.harness.cpu",
     "benchmarks.harness.scrape", "benchmarks.harness.report", "benchmarks.harness.flags", "benchmarks.harness.child"],
])
def test_torch_free_processes_never_load_torch(modules):
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules) + \
        "loaded = sorted(m for m in ('torch', 'triton') if m in sys.modules)\nprint(loaded)\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", f"{modules} loaded {result.stdout.strip()}"


def test_root_conftest_imports_no_torch():
    # Pure-Python tests (scheduler, tokenizer, common) run without paying for torch.
    code = "import sys; import tests.conftest; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


def test_the_gpu_check_imports_none_of_the_services_dependencies_at_start():
    # The GPU image runs the checkout without installing its dependencies (no structlog, no grpc):
    # `python -m benchmarks gpu` must get as far as its sections, which import the rest when they run.
    code = ("import sys, benchmarks.__main__, benchmarks.gpu_check\n"
            "print(sorted(m for m in ('structlog', 'grpc', 'services.common.errors') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_test_modules_have_unique_names():
    # tests/ has no __init__.py files (pytest's rootdir import mode), so two test modules with
    # one basename stop a whole-suite collection while each still passes run alone.
    tests = Path(__file__).resolve().parent
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(tests.rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(tests)} and {path.relative_to(tests)}")
        seen.setdefault(path.name, path)
    assert not clashes, f"test modules sharing a name: {clashes}"
