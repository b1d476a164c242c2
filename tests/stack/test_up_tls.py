"""``tokenmill up --tls`` as a developer runs it: a throwaway CA in the run directory, mTLS on
every hop, the demo streamed over it, and the printed CA and client certificate enough for a
client to call the public API (a plaintext client is refused)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import grpc
import pytest

from services.common.pb.tokenmill.v1 import common_pb2
from services.common.tls import ClientTLS
from services.stack.client import generate, model_info
from tests.helpers.service_harness import REPO_ROOT
from tests.helpers.stack_streams import greedy_request

pytestmark = pytest.mark.slow  # starts the four services as processes

TLS_LINE = re.compile(r"mTLS on every hop; CA (\S+), client certificate (\S+), key (\S+)")
SERVING_LINE = re.compile(r"serving on (\S+);")


@pytest.mark.timeout(240)
def test_up_tls_streams_the_demo_and_serves_a_client_with_the_printed_certificates(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("TOKENMILL_TLS_CA", "TOKENMILL_TLS_CERT", "TOKENMILL_TLS_KEY"):
        env.pop(name, None)  # the demo must use the launcher's certificates, not the caller's
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "up", "--tls", "--port", "0", "--log-dir", str(tmp_path / "logs"),
         "--executor-arg=--num-blocks=128", "--executor-arg=--attention-backend=torch"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    try:
        address = tls = None
        for line in proc.stderr:
            stderr.append(line)
            if match := TLS_LINE.search(line):
                tls = ClientTLS(*match.groups())
            if match := SERVING_LINE.search(line):
                address = match.group(1)
                break
        assert address and tls, "".join(stderr)
        assert all(os.path.isfile(path) for path in (tls.ca, tls.cert, tls.key))
        assert f"TOKENMILL_TLS_CA={tls.ca}" in "".join(stderr)  # the command line to copy is printed

        env_tls = ClientTLS.from_env({"TOKENMILL_TLS_CA": tls.ca, "TOKENMILL_TLS_CERT": tls.cert,
                                      "TOKENMILL_TLS_KEY": tls.key})
        messages = list(generate(address, greedy_request("Once upon a time", 8), timeout=60, tls=env_tls))
        finished = messages[-1].finished
        assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH and finished.usage.completion_tokens == 8
        with pytest.raises(grpc.RpcError) as plaintext:
            model_info(address, timeout=5, tls=None)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, rest = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, rest = proc.communicate()
    stderr.append(rest)
    assert proc.returncode == 0, "".join(stderr)
    # The demo: the prompt, then a continuation streamed over mTLS, then its stats line.
    assert out.startswith("Once upon a time") and len(out.strip()) > len("Once upon a time") + 20, out
    assert re.search(r"\[\d+ tokens, finish=", "".join(stderr)), "".join(stderr)
