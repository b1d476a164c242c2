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
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
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
