"""`tokenmill up --replicas 2` puts the gateway in front of two engines, and the curl and openai
commands it prints work as printed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from services.cli.up import parse_up_config
from services.stack.gateway_launcher import replica_routes
from tests.conftest import REPO_ROOT


def test_replica_routes_route_one_model_over_every_engine():
    routes = replica_routes("stories260K", ["127.0.0.1:1", "127.0.0.1:2"], "models/stories260K")
    assert routes["models"]["stories260K"]["route"] == {"strategy": "latency", "targets": ["replica-0", "replica-1"]}
    assert [t["address"] for t in routes["targets"]] == ["127.0.0.1:1", "127.0.0.1:2"]
    args = parse_up_config([])
    assert (args.replicas, args.http_port, args.gateway_port, args.gateway) == (1, 8000, 50050, True)
    args = parse_up_config(["--replicas", "3", "--gateway-arg=--max-attempts=2", "--gateway-arg=--http-port=1"])
    assert args.replicas == 3 and args.gateway_arg == ("--max-attempts=2", "--http-port=1")
    with pytest.raises(SystemExit) as exited:
        parse_up_config(["--replicas", "0"])
    assert exited.value.code == 2


@pytest.mark.slow
def test_up_with_two_replicas_serves_the_printed_examples(tmp_path):
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "services.cli.main", "up", "--replicas", "2", "--port", "0", "--http-port", "0",
           "--gateway-port", "0", "--no-demo", "--log-dir", str(tmp_path / "logs"),
           "--executor-arg=--attention-backend=torch", "--executor-arg=--num-blocks=256"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C to stop" in line:
                break
        text = "".join(lines)
        assert "Ctrl-C to stop" in text, text
        assert text.count("scheduler[") == 2, text  # two engines
        curl = re.search(r"^\[tokenmill up\]   (curl .*)$", text, re.M).group(1)
        python = re.search(r"^\[tokenmill up\]   (\S*python\S* -c .*)$", text, re.M).group(1)
        reply = json.loads(subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60).stdout)
        assert reply["object"] == "text_completion" and reply["choices"][0]["text"]
        printed = subprocess.run(["bash", "-c", python], capture_output=True, text=True, timeout=60, env=env)
        assert printed.returncode == 0 and printed.stdout.strip(), printed.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0


@pytest.mark.parametrize("chat", [True, False])
def test_printed_examples_are_valid_commands(capsys, tmp_path, chat):
    import shlex

    from services.cli.up import _print_examples
    from services.stack.gateway_launcher import GatewayProcess

    _print_examples(GatewayProcess({}, tmp_path, http_port=8123, grpc_port=50123), "smollm2-135m-instruct-q4_1", chat)
    err = capsys.readouterr().err
    curl = shlex.split(re.search(r"^\[tokenmill up\]   (curl .*)$", err, re.M).group(1))
    body = json.loads(curl[curl.index("-d") + 1])
    assert body["model"] == "smollm2-135m-instruct-q4_1" and ("messages" in body) == chat
    assert curl[2] == "http://127.0.0.1:8123/v1/" + ("chat/completions" if chat else "completions")
    python = shlex.split(re.search(r"^\[tokenmill up\]   (\S*python\S* -c .*)$", err, re.M).group(1))
    assert python[0] == sys.executable and python[1] == "-c"
    compile(python[2], "<printed>", "exec")
    assert 'base_url="http://127.0.0.1:8123/v1"' in python[2]
