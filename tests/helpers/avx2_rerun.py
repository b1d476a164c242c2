"""A pytest plugin for the AVX2-only rerun of the C++ kernel tests (tests/runtime/kernels/test_cpu_kernels_avx2.py).

That rerun proves what changes with ``-march=haswell``: the C++ code compiled without AVX-512.
Tests that never enter that code prove nothing new there and are left to the main run:
- those taking the ``device`` fixture run Triton kernels (in Triton's interpreter on a CPU, numpy
  underneath), except a case of the ``cpu`` attention backend, which is the C++ kernel;
- the ``avx512_vnni`` case of the ``isa`` fixture runs a path an AVX2-only CPU never takes.
Deselected tests are counted in the run's summary, so the rerun's output shows what it left out.
"""

from __future__ import annotations

import pytest


def runs_no_avx2_build_code(item: pytest.Item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "device" in getattr(item, "fixturenames", ()) and params.get("backend") != "cpu":
        return True
    return params.get("isa") == "avx512_vnni"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    left = [item for item in items if runs_no_avx2_build_code(item)]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if not runs_no_avx2_build_code(item)]
