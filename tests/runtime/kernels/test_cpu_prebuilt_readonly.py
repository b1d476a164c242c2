"""The image builds the CPU kernels ahead of time into a root-owned directory and runs under a
read-only root filesystem: loading that build must not write anything (torch's own build step
writes its ``lock`` baton, ``build.ninja`` and ninja's log there)."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from services.runtime.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels cannot be built here")

ROOT = Path(__file__).resolve().parents[3]
_LOAD = ("from services.runtime.kernels import cpu\n"
         "try:\n    cpu.load()\nexcept cpu.CpuKernelsUnavailable as exc:\n    print('unavailable:', exc)\n"
         "else:\n    print('loaded', cpu.isa())\n")


def _run_unprivileged(extensions_dir: Path) -> subprocess.CompletedProcess:
    """Load the kernels in a fresh process with TORCH_EXTENSIONS_DIR there, as a user who cannot
    write it (root writes through any mode bits, so as root the process drops to nobody)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(extensions_dir),
           "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(extensions_dir)}
    command = [sys.executable, "-c", _LOAD]
    if os.geteuid() == 0:
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def _listing(top: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(top)): (p.stat().st_size, p.stat().st_mtime_ns) for p in top.rglob("*")}


@pytest.fixture
def extensions_dir():
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot drop to a user that read-only modes bind")
    from torch.utils import cpp_extension

    cpu.load()  # this checkout's build, as `make install` or the image's build stage leaves it
    built = Path(cpp_extension._get_build_directory(cpu.build_name(), verbose=False))
    top = Path(tempfile.mkdtemp(prefix="tokenmill-prebuilt-"))
    top.chmod(0o755)  # the unprivileged process must reach it
    yield top, built
    for path in (top, *top.rglob("*")):
        if path.is_dir():
            path.chmod(0o755)
    shutil.rmtree(top)


def test_a_read_only_prebuilt_build_loads_without_writing(extensions_dir):
    top, built = extensions_dir
    shutil.copytree(built, top / built.name)
    (top / built.name / "lock").unlink(missing_ok=True)
    subprocess.run(["chmod", "-R", "a-w", str(top)], check=True)
    before = _listing(top)
    done = _run_unprivileged(top)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("loaded"), (done.stdout, done.stderr[-2000:])
    assert _listing(top) == before  # nothing written, not even a lock file


def test_a_read_only_directory_without_the_build_says_what_is_missing(extensions_dir):
    top, _ = extensions_dir
    subprocess.run(["chmod", "-R", "a-w", str(top)], check=True)
    done = _run_unprivileged(top)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("unavailable:") and str(top) in done.stdout, done.stdout
