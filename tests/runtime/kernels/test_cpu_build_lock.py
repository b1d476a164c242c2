"""A build killed midway leaves torch's ``lock`` file behind; the next start must not wait on it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.runtime.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels cannot be built here")

_LOAD = "from services.runtime.kernels import cpu; cpu.load(); print('loaded')"


def test_a_stale_build_lock_does_not_hang_the_next_start():
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(cpu.build_name(), verbose=False))
    (build_dir / "lock").touch()  # what a build killed between its start and its end leaves
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", _LOAD], cwd=root, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "loaded"
    assert not (build_dir / "lock").exists()



def test_loading_leaves_the_build_name_as_it_was():
    """torch appends to the flag lists it is given; a process that has loaded the kernels must
    still name the build as a fresh one does (the collection above has loaded them here)."""
    cpu.load()
    root = Path(__file__).resolve().parents[3]
    fresh = subprocess.run([sys.executable, "-c", "from services.runtime.kernels import cpu; print(cpu.build_name())"],
                           cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                           text=True, timeout=120, check=True)
    assert cpu.build_name() == fresh.stdout.strip()
