"""Client commands find the stack the way `tokenmill up` was told to listen: TOKENMILL_ADDRESS,
else loopback at TOKENMILL_SCHEDULER_PORT (once `tokenmill profile` ignored both)."""

from __future__ import annotations

import os
import subprocess

from services.stack.client import default_address
from tests.helpers.service_harness import REPO_ROOT


def test_client_commands_follow_the_documented_variables():
    assert default_address({}) == "127.0.0.1:50051"
    assert default_address({"TOKENMILL_SCHEDULER_PORT": "6001"}) == "127.0.0.1:6001"
    assert default_address({"TOKENMILL_SCHEDULER_PORT": "6001", "TOKENMILL_ADDRESS": "h:7"}) == "h:7"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env |= {"PYTHONPATH": str(REPO_ROOT), "TOKENMILL_SCHEDULER_PORT": "1"}
    for command in ("generate", "profile"):
        # Nothing listens on port 1: the command reaches for it, and says where it looked.
        done = subprocess.run([str(REPO_ROOT / ".venv" / "bin" / "tokenmill"), command, "--chat", "hi"][
                              :2 if command == "profile" else 4], env=env, capture_output=True, text=True, timeout=60,
                              cwd=REPO_ROOT)
        assert done.returncode == 1 and "UNAVAILABLE" in done.stderr and "127.0.0.1:1)" in done.stderr, done.stderr
        done = subprocess.run([str(REPO_ROOT / ".venv" / "bin" / "tokenmill"), command, "--help"],
                              env=env | {"TOKENMILL_ADDRESS": "127.0.0.2:9"}, capture_output=True, text=True,
                              timeout=60, cwd=REPO_ROOT)
        assert "127.0.0.2:9)" in " ".join(done.stdout.split()), done.stdout
