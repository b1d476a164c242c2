"""The C++ CPU kernels built for an AVX2-only CPU (``-march=haswell``) pass the same tests.

Machines differ: some have AVX-512, some only AVX2, and the kernels are compiled for the machine
they run on. The code paths a build without AVX-512 takes (the portable loops beside the
AVX-512 ones, F16C conversions) would otherwise run only where CI happens to land on such a
CPU. TOKENMILL_CPU_KERNEL_MARCH=haswell builds them that way here (a separate cached build);
the kernel test files then run in a subprocess against their references, less the tests that
never enter the C++ code (tests/helpers/avx2_rerun.py: the Triton ones and the AVX-512 path),
which the main run covers and which took most of this one's time.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

# One more build of the extension: `make test` starts it in the background, so the test runs last
# and its first load waits on the build's flock. The timeout covers a build not yet started (pytest
# by hand) on a loaded 2-core machine (13 minutes measured) plus the rerun.
pytestmark = [pytest.mark.slow, pytest.mark.background_build, pytest.mark.timeout(1800)]

KERNEL_TESTS = ["tests/runtime/kernels/test_cpu_paged_decode.py", "tests/runtime/kernels/test_softcap.py",
                "tests/runtime/kernels/test_kv_quant.py",
                "tests/runtime/kernels/test_shm_all_reduce.py",
                "tests/runtime/kernels/test_quant_dot.py", "tests/runtime/kernels/test_kquant_dot.py",
                "tests/runtime/kernels/test_moe_experts.py",
                "tests/runtime/kernels/test_quant_matmul.py", "tests/runtime/model/test_quant.py",
                "tests/runtime/kernels/test_lora.py", "tests/runtime/model/test_fused_decode_lora.py",
                "tests/runtime/model/test_fused_moe_step.py::test_experts_kept_in_their_gguf_blocks_run_fused_as_eagerly",
                "tests/runtime/model/test_fused_decode.py::"
                "test_a_k_quant_models_tied_q8_0_head_takes_int8_activations_by_default"]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-march=haswell names an x86-64 CPU")
def test_cpu_kernels_built_for_avx2_pass_their_tests():
    env = {**os.environ, "TOKENMILL_CPU_KERNEL_MARCH": "haswell"}
    probe = subprocess.run(
        [sys.executable, "-c", "from services.runtime.kernels import cpu; cpu.load(); print(cpu._CFLAGS)"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert probe.returncode == 0 and "-march=haswell" in probe.stdout, probe.stderr[-3000:]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.helpers.avx2_rerun",
         "-m", "not slow", *KERNEL_TESTS],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
    assert " deselected" in done.stdout, done.stdout[-2000:]  # the plugin ran: the rerun is the narrowed one
