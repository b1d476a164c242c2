"""Shared fixtures: the shipped default model and small random-weight model directories.

This file imports no torch: the pure-Python tests (scheduler, tokenizer, common) run without
loading it. What torch and Triton need is set through the environment before either is imported
(the root conftest is loaded first).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest


def _has_cuda_device() -> bool:
    # A CUDA device node, looked up without importing torch.
    return any(Path("/dev").glob("nvidia[0-9]*"))


if not _has_cuda_device():
    # Without a GPU, Triton kernels run in Triton's interpreter: read when a kernel is decorated.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread (torch reads this when it starts): on a small shared CPU a second OpenMP
# thread makes small ops wait for a descheduled peer (measured up to 10x slower); results do not
# depend on it. Service processes started by tests inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `llama_cpp` and `background_build` tests run last: `make test` builds llama-cpp-python and the
    # AVX2-only kernels in the background meanwhile (tests/helpers/llama_cpp_build.py). A stable
    # sort keeps every other order as collected.
    items.sort(key=lambda item: any(item.get_closest_marker(name) for name in ("llama_cpp", "background_build")))
    # `gpu` tests need a CUDA device; on a CPU machine they are reported as skipped, with the reason.
    if _has_cuda_device():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

_module_began: dict[str, float] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # When each module's first test began: its stacks' logs are those written since (minus the
    # file systems' coarse mtimes).
    _module_began.setdefault(item.nodeid.split("::")[0], time.time() - 2.0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    # A failed test's report carries its stacks' service logs (tests/helpers/stack_logs.py).
    report = yield
    if report.failed:
        from tests.helpers import stack_logs

        factory = getattr(item.config, "_tmp_path_factory", None)
        since = _module_began.get(item.nodeid.split("::")[0], time.time() - 600)
        try:
            temp_root = factory.getbasetemp() if factory is not None else None
        except Exception:  # noqa: BLE001 - no temporary root yet: no logs under it
            temp_root = None
        for title, text in stack_logs.sections(temp_root, since):
            report.sections.append((title, text))
    return report


REPO_ROOT = Path(__file__).resolve().parents[1]
STORIES_DIR = REPO_ROOT / "models" / "stories260K"

@pytest.fixture(scope="session")
def stories_dir() -> Path:
    assert (STORIES_DIR / "config.json").is_file(), "the default model must ship in models/stories260K"
    return STORIES_DIR


@pytest.fixture(scope="session")
def random_model_dirs(tmp_path_factory) -> dict[str, Path]:
    from services.tools.random_model import build_random_model
    from tests.helpers.parity_specs import PARITY_SPECS

    root = tmp_path_factory.mktemp("random_models")
    return {name: build_random_model(spec, root / name, tokenizer_from=STORIES_DIR if spec.vocab_size >= 512 else None)
            for name, spec in PARITY_SPECS.items()}
