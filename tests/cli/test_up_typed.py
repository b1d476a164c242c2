"""`tokenmill up` typed as a person types it, with engine auth: it serves with the demo off, and a
demo that fails is reported while the stack serves on; the commands it prints reach its stack;
a stop leaves nothing behind in the temporary directory.

Once `--no-demo` could not turn the demo off (the field was named no_demo) and the demo, sent
without a token, failed UNAUTHENTICATED and took the whole stack down: `tokenmill up` with
auth could not be started at all."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers.service_harness import REPO_ROOT
from tests.helpers.typed_up import SERVING, moved_ports, start_up, user_env

pytestmark = pytest.mark.slow

TOKENMILL = REPO_ROOT / ".venv" / "bin" / "tokenmill"


def _tenants(directory, tenants: list[dict]) -> None:
    path = directory / "tenants.json"
    path.write_text(json.dumps(tenants))
    path.chmod(0o600)


def _run(command: str, env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _typed_up(tmp_path, flags: str):
    """`tokenmill up FLAGS` in tmp_path (relative paths are under it)."""
    env = user_env(**moved_ports())
    return start_up(f"{TOKENMILL} up {flags}", env, cwd=tmp_path), env


def _run_dir(text: str) -> Path:
    """The temporary directory `up` keeps its port files in (the scheduler's --port-file names it),
    read from the command line of the scheduler whose pid it printed."""
    pid = re.search(r"scheduler\s+SERVING on \S+ \(pid (\d+)\)", text).group(1)
    argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    return Path(argv[argv.index("--port-file") + 1]).parent


def test_up_with_auth_and_no_demo_serves_the_commands_it_prints(tmp_path):
    _tenants(tmp_path, [{"token": "s3cret", "tenant": "team-a"}])
    up, env = _typed_up(tmp_path, "--no-demo --scheduler-arg=--auth-tokens-file=tenants.json")
    try:
        text = up.wait_for(SERVING, 240)
        assert "demo (" not in text and "demo failed" not in text, text
        run_dir = _run_dir(text)
        assert (run_dir / "gateway" / "gateway-routes.json").exists()
        commands = up.printed_commands()
        generate = next(c for c in commands if " generate " in c)
        assert f":{env['TOKENMILL_GATEWAY_PORT']} " in generate  # its own stack: the gateway's moved port
        refused = _run(generate, env, tmp_path)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
        with_token = env | {"TOKENMILL_TOKEN": "s3cret"}
        done = _run(generate, with_token, tmp_path)
        assert done.returncode == 0 and len(done.stdout) > len("Once upon"), done.stderr
        curl = next(c for c in commands if c.startswith("curl "))
        reply = json.loads(_run(curl, with_token, tmp_path).stdout)
        assert reply["choices"][0]["text"], reply
        python = next(c for c in commands if " -c " in c and "openai" in c)
        printed = _run(python, with_token, tmp_path)
        assert printed.returncode == 0 and printed.stdout.strip(), printed.stderr
        # Without --address a client command finds the stack by TOKENMILL_SCHEDULER_PORT (as `up`
        # did), or by TOKENMILL_ADDRESS.
        port = env["TOKENMILL_SCHEDULER_PORT"]
        without_port = {k: v for k, v in with_token.items() if k != "TOKENMILL_SCHEDULER_PORT"}
        for client_env in (with_token, without_port | {"TOKENMILL_ADDRESS": f"127.0.0.1:{port}"}):
            profile = _run(f"{TOKENMILL} profile --json", client_env, tmp_path)
            assert profile.returncode == 0 and json.loads(profile.stdout)["num_requests"] >= 1, profile.stderr
    finally:
        assert up.stop() == 0, up.text
    assert not run_dir.exists()  # the port files, and the gateway's routes file (once in a directory of its own)


def test_a_failing_demo_is_reported_and_the_stack_serves_on(tmp_path):
    # The demo presents the first tenant that may use the model; its budget cannot hold the
    # demo's request, which is refused.
    _tenants(tmp_path, [{"token": "tiny", "tenant": "small", "tokens_per_minute": 1},
                        {"token": "s3cret", "tenant": "team-a"}])
    up, env = _typed_up(tmp_path, "--scheduler-arg=--auth-tokens-file=tenants.json")
    try:
        text = up.wait_for(SERVING, 240)
        assert "with a tenant's token" in text and "demo failed: RESOURCE_EXHAUSTED" in text, text
        generate = next(c for c in up.printed_commands() if " generate " in c)
        done = _run(generate, env | {"TOKENMILL_TOKEN": "s3cret"}, tmp_path)
        assert done.returncode == 0 and len(done.stdout) > len("Once upon"), done.stderr
    finally:
        assert up.stop() == 0, up.text
