"""A service that nobody authenticates does not start unless that is typed: an internal service with
neither the deployment's secret nor mTLS, a scheduler with no credential for its backends. The
refusal names both ways out (a credential, or --allow-unauthenticated)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli.main import main as tokenmill
from services.common.service_config import read_port_file
from tests.conftest import STORIES_DIR
from tests.helpers.service_harness import REPO_ROOT

INTERNAL_REFUSAL = ("no caller authentication: set --internal-secret-file (the deployment's secret; `tokenmill up` "
                    "writes one) or mTLS (--tls-client-ca, best with --tls-allowed-clients), or type "
                    "--allow-unauthenticated to let any process that reaches the port call")


def _clean_env() -> dict[str, str]:
    """The caller's environment without any TOKENMILL_* setting, as a person's shell has it."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("TOKENMILL_")}
    return {**env, "PYTHONPATH": str(REPO_ROOT)}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_executor_process_without_secret_or_opt_out_exits_naming_both_ways_out(tmp_path) -> None:
    port_file = tmp_path / "executor.port"
    done = subprocess.run([sys.executable, "-m", "services.executor", "--port", "0", "--port-file", str(port_file),
                           "--model", str(STORIES_DIR), "--device", "cpu"],
                          cwd=REPO_ROOT, env=_clean_env(), capture_output=True, text=True, timeout=100)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"tokenmill serve executor: error: {INTERNAL_REFUSAL}"
    assert not port_file.exists()  # refused before it bound anything


@pytest.mark.parametrize("service", ["tokenizer", "drafter"])
def test_every_internal_service_refuses_the_same_way(service, monkeypatch, capsys) -> None:
    for name in [name for name in os.environ if name.startswith("TOKENMILL_")]:
        monkeypatch.delenv(name)
    assert tokenmill(["serve", service, "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == f"tokenmill serve {service}: error: {INTERNAL_REFUSAL}"


def test_a_scheduler_without_a_credential_for_its_backends_is_refused(monkeypatch, capsys) -> None:
    for name in [name for name in os.environ if name.startswith("TOKENMILL_")]:
        monkeypatch.delenv(name)
    assert tokenmill(["serve", "scheduler", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tokenmill serve scheduler: error: no credential for the backends: set --internal-secret-file (the "
        "deployment's secret; `tokenmill up` writes one) or a client certificate (--backend-tls-cert), or type "
        "--allow-unauthenticated to call them without credentials")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_opt_out_as_an_environment_variable_starts_a_real_process(tmp_path) -> None:
    """TOKENMILL_<SERVICE>_ALLOW_UNAUTHENTICATED, set in the shell as a person sets it, is the
    flag's other form: the tokenizer process starts and answers; set to 0, or overridden by
    --no-allow-unauthenticated on the command line, it is refused as without it."""
    tokenmill_script = str(Path(sys.executable).parent / "tokenmill")
    argv = [tokenmill_script, "serve", "tokenizer", "--port", "0", "--model", str(STORIES_DIR)]
    for value, extra in (("0", []), ("1", ["--no-allow-unauthenticated"])):
        done = subprocess.run([*argv, *extra], cwd=REPO_ROOT, capture_output=True, text=True, timeout=100,
                              env={**_clean_env(), "TOKENMILL_TOKENIZER_ALLOW_UNAUTHENTICATED": value})
        assert done.returncode == 2, (value, extra, done.stderr)
        assert done.stderr.strip() == f"tokenmill serve tokenizer: error: {INTERNAL_REFUSAL}"
    port_file = tmp_path / "tokenizer.port"
    process = subprocess.Popen([*argv, "--port-file", str(port_file)], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True,
                               env={**_clean_env(), "TOKENMILL_TOKENIZER_ALLOW_UNAUTHENTICATED": "true"})
    try:
        deadline = time.monotonic() + 90
        while not port_file.exists():
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the tokenizer never wrote its port file"
            time.sleep(0.1)
        port = read_port_file(port_file)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        process.terminate()
        process.wait(timeout=30)
