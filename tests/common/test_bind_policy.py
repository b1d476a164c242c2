"""Where a service may listen without the protection its port needs (services/common/bind_policy.py):
internal services off loopback only with mTLS, the scheduler's bearer tokens off loopback only
over TLS, unless --allow-insecure-bind; and /metrics on loopback whatever --host is."""

from __future__ import annotations

import pytest

from services.common.bind_policy import check_bind, is_loopback
from services.common.metrics import _servers
from services.executor.config import ExecutorServiceConfig
from services.scheduler.config import SchedulerServiceConfig
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import serve as serve_tokenizer
from tests.helpers.service_harness import STORIES_DIR


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.7", False), ("scheduler.internal", False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


def test_internal_services_need_mtls_off_loopback():
    check_bind(ExecutorServiceConfig(host="127.0.0.1"), "executor")
    with pytest.raises(ValueError, match=r"executor: --host 0.0.0.0 without client certificates"):
        check_bind(ExecutorServiceConfig(host="0.0.0.0"), "executor")
    with pytest.raises(ValueError, match=r"tokenizer: --host 10.0.0.7 without client certificates"):
        check_bind(TokenizerConfig(host="10.0.0.7", tls_cert="c.pem", tls_key="k.pem"), "tokenizer")  # TLS, no mTLS
    check_bind(TokenizerConfig(host="0.0.0.0", tls_cert="c.pem", tls_key="k.pem", tls_client_ca="ca.pem"), "tokenizer")
    check_bind(ExecutorServiceConfig(host="0.0.0.0", allow_insecure_bind=True), "executor")


def test_bearer_tokens_travel_over_tls_off_loopback():
    check_bind(SchedulerServiceConfig(host="0.0.0.0"), "scheduler")  # no tokens: a public plaintext API
    check_bind(SchedulerServiceConfig(host="127.0.0.1", auth_tokens_file="t.json"), "scheduler")  # warned
    with pytest.raises(ValueError, match=r"would carry bearer tokens in plaintext"):
        check_bind(SchedulerServiceConfig(host="0.0.0.0", auth_tokens_file="t.json"), "scheduler")
    check_bind(SchedulerServiceConfig(host="0.0.0.0", auth_tokens_file="t.json", tls_cert="c.pem", tls_key="k.pem"),
               "scheduler")


async def test_metrics_listen_on_loopback_whatever_the_grpc_host():
    running = await serve_tokenizer(TokenizerConfig(port=0, host="0.0.0.0", allow_insecure_bind=True, metrics_port=0,
                                                    model=str(STORIES_DIR)))
    try:
        assert running.host == "0.0.0.0"
        assert _servers[running.metrics_port].server_address[0] == "127.0.0.1"
    finally:
        await running.stop(grace=0)
