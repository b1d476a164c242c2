"""components/tls run from the manifests: the cpu overlay with auth and TLS, rendered, as local
processes (tests/deploy/manifests.py), the Secrets tokenmill-tls-SERVICE made here (one CA, one
certificate per service for serving and connecting, named by the service, for 127.0.0.1, where
every cluster name maps locally).

Every probe the manifests declare reaches SERVING in plaintext on its service's health port while
the service's own port refuses plaintext; a request streams through the gateway (HTTP, and gRPC
over TLS) over mTLS hops to the scheduler and its executor, tokenizer and drafter; the scheduler's
public port refuses a client without a certificate from the CA, and takes the gateway's alone; the
executor refuses the gateway's certificate and serves the scheduler's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc
import pytest
import pytest_asyncio

from services.common.internal_secret import METADATA_KEY
from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc, generation_pb2_grpc
from services.common.server import create_channel
from services.common.tls import ClientTLS
from services.stack.dev_ca import cert_pem, issue, key_pem, make_authority
from tests.deploy.manifests import LocalCluster, parse_container, probe_targets, render_variant, service_module
from tests.deploy.test_manifests_run import (
    ENGINE, GATEWAY, INTERNAL_SECRET, PROMPT, START_TIMEOUT_S, TOKEN, _gateway_client, _gateway_ready, _gateway_stream,
    _health, _Tenant,
)
from tests.helpers.stack_streams import greedy_request, record_stream

# slow: starts the cpu overlay's pods with TLS as processes
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]


SERVICES = ("gateway", "scheduler", "executor", "tokenizer", "drafter")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, dict]:
    """Per service: its files here (for the test's own clients) and its Secret's data."""
    authority = make_authority()
    out: dict[str, dict] = {}
    for service in SERVICES:
        cert, key = issue(authority, f"tokenmill-{service}", server=True, client=True)
        folder = tmp_path_factory.mktemp(f"tls-{service}")
        files = {"ca.crt": cert_pem(authority.cert), "tls.crt": cert_pem(cert), "tls.key": key_pem(key)}
        for name, data in files.items():
            (folder / name).write_bytes(data)
        out[service] = {name: str(folder / name) for name in files} | {
            "data": {k: v.decode() for k, v in files.items()}}
    return out


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory, pki) -> Iterator[LocalCluster]:
    workdir = tmp_path_factory.mktemp("tls-cluster")
    docs = render_variant("cpu+auth+tls", workdir)
    secrets = {"tokenmill-auth": {"tokens.json": json.dumps([{"token": TOKEN, "tenant": "deploy-test"}])},
               "tokenmill-internal": {"secret": INTERNAL_SECRET},
               **{f"tokenmill-tls-{service}": pki[service]["data"] for service in SERVICES}}
    local = LocalCluster(docs, workdir, secrets=secrets, extra_env={"OMP_NUM_THREADS": "1"})
    local.start(startup_timeout_s=START_TIMEOUT_S)
    yield local
    local.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def serving(tls_cluster: LocalCluster) -> LocalCluster:
    for pod in tls_cluster.pods.values():
        for container, _, probe in probe_targets(pod):
            await asyncio.to_thread(tls_cluster.wait_probe, pod, container, probe, START_TIMEOUT_S)
    return tls_cluster


async def test_probes_answer_on_the_health_ports_and_the_services_refuse_plaintext(serving: LocalCluster):
    for pod in serving.pods.values():
        for container, kind, probe in probe_targets(pod):
            address = f"127.0.0.1:{pod.local_port(probe['grpc']['port'], container)}"
            assert await _health(address, probe["grpc"].get("service", "")) == "SERVING", (pod.name, container, kind)
        for container in pod.containers:
            config, _ = parse_container(service_module(container), container.get("args", []),
                                        serving.env_of(pod, container))
            address = f"127.0.0.1:{pod.local_port(config.port, container['name'])}"
            assert await _health(address, "") == "UNAVAILABLE", (pod.name, container["name"], "plaintext answered")


async def test_a_request_streams_through_the_gateway_over_tls_hops(serving: LocalCluster, pki):
    await _gateway_ready(serving)
    async with _gateway_client(serving) as client:
        text, reasons, tokens, _ = await _gateway_stream(client, 24)
    assert reasons == ["length"] and tokens == 24 and text.strip()
    # The gateway's public gRPC port: TLS, no client certificate needed.
    port = serving.pods[GATEWAY].local_port("grpc", "test client")
    async with create_channel(f"127.0.0.1:{port}", tls=ClientTLS(pki["gateway"]["ca.crt"])) as channel:
        routed = await record_stream(_Tenant(generation_pb2_grpc.GenerationStub(channel), TOKEN),
                                     greedy_request(PROMPT, 24))
    assert routed.finish_reason == "length" and routed.text == text, (routed.code, routed.details)


async def test_the_scheduler_asks_for_a_client_certificate(serving: LocalCluster, pki):
    port = serving.pods[ENGINE].local_port(50051, "test client")
    async with create_channel(f"127.0.0.1:{port}", tls=ClientTLS(pki["gateway"]["ca.crt"])) as channel:
        anonymous = await record_stream(_Tenant(generation_pb2_grpc.GenerationStub(channel), TOKEN),
                                        greedy_request(PROMPT, 4), timeout=10)
    assert anonymous.code == grpc.StatusCode.UNAVAILABLE and not anonymous.messages, anonymous.code
    for service in ("executor", "tokenizer"):  # the CA signed them, but only the gateway may call here
        other = ClientTLS(pki[service]["ca.crt"], pki[service]["tls.crt"], pki[service]["tls.key"])
        async with create_channel(f"127.0.0.1:{port}", tls=other) as channel:
            refused = await record_stream(_Tenant(generation_pb2_grpc.GenerationStub(channel), TOKEN),
                                          greedy_request(PROMPT, 4), timeout=10)
        assert refused.code == grpc.StatusCode.PERMISSION_DENIED and not refused.messages, (service, refused.code)
    gateway = pki["gateway"]
    mtls = ClientTLS(gateway["ca.crt"], gateway["tls.crt"], gateway["tls.key"])
    async with create_channel(f"127.0.0.1:{port}", tls=mtls) as channel:
        record = await record_stream(_Tenant(generation_pb2_grpc.GenerationStub(channel), TOKEN),
                                     greedy_request(PROMPT, 4), timeout=30)
    assert record.finish_reason == "length", (record.code, record.details)


async def test_the_gateways_certificate_cannot_drive_the_executor(serving: LocalCluster, pki):
    port = serving.pods[ENGINE].local_port(50053, "test client")
    secret = ((METADATA_KEY, INTERNAL_SECRET),)  # so only the certificate differs between the calls

    async def info(service: str) -> grpc.StatusCode:
        files = pki[service]
        async with create_channel(f"127.0.0.1:{port}", tls=ClientTLS(files["ca.crt"], files["tls.crt"],
                                                                      files["tls.key"])) as channel:
            try:
                await executor_pb2_grpc.ExecutorStub(channel).GetExecutorInfo(
                    executor_pb2.GetExecutorInfoRequest(), metadata=secret, timeout=10)
            except grpc.aio.AioRpcError as err:
                return err.code()
        return grpc.StatusCode.OK

    assert await info("gateway") == grpc.StatusCode.PERMISSION_DENIED
    assert await info("tokenizer") == grpc.StatusCode.PERMISSION_DENIED
    assert await info("scheduler") == grpc.StatusCode.OK
