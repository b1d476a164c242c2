"""The plaintext health-only port beside a TLS server (start_server's health_port, a service's
--health-port): what a kubelet's gRPC probe, which has no certificate, can ask. It answers the
health of the TLS server's services, and nothing else; it turns NOT_SERVING when the server stops,
while the server's calls are still finishing, and closes once they are done."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.server import create_channel, start_server
from services.common.settings import parse_config
from services.common.tls import ClientTLS, ServerTLS
from services.stack.dev_ca import write_dev_certificates
from services.tokenizer.config import TokenizerConfig

WATCHED = "tokenmill.test.Watched"


async def _status(address: str, service: str = "", tls: ClientTLS | None = None) -> str:
    async with create_channel(address, tls=tls) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.aio.AioRpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def test_health_port_answers_plaintext_beside_an_mtls_port(tmp_path: Path):
    pki = write_dev_certificates(tmp_path / "pki")
    tls = ServerTLS(str(pki.server_cert), str(pki.server_key), str(pki.ca))
    running = await start_server("probed", lambda server: [WATCHED], port=0, tls=tls, health_port=0)
    try:
        health = f"127.0.0.1:{running.health_port}"
        assert running.health_port not in (None, 0, running.port)
        assert await _status(health) == "SERVING"
        assert await _status(health, WATCHED) == "SERVING"
        assert await _status(running.address) == "UNAVAILABLE"  # the main port is TLS only
        mtls = ClientTLS(str(pki.ca), str(pki.client_cert), str(pki.client_key))
        assert await _status(running.address, tls=mtls) == "SERVING"
        # Nothing but health on the plaintext port: reflection (served on the TLS port) is not there.
        async with create_channel(health) as channel:
            call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        await running.set_serving(False)
        assert await _status(health, WATCHED) == "NOT_SERVING"
    finally:
        await running.stop(grace=0)
    assert await _status(health) == "UNAVAILABLE"  # closed with the server


async def test_health_port_is_not_serving_while_the_server_drains(tmp_path: Path):
    running = await start_server("draining", lambda server: [WATCHED], port=0, health_port=0)
    health = f"127.0.0.1:{running.health_port}"
    released = asyncio.Event()

    async def hold(grace: float) -> None:  # a service's drain: its streams still finishing
        await released.wait()

    running.on_stopping(hold)
    stopping = asyncio.ensure_future(running.stop(grace=10))
    for _ in range(100):
        if await _status(health) == "NOT_SERVING":
            break
        await asyncio.sleep(0.02)
    assert await _status(health, WATCHED) == "NOT_SERVING"
    released.set()
    await asyncio.wait_for(stopping, 10)
    assert await _status(health) == "UNAVAILABLE"


def test_health_port_is_a_setting_of_every_service():
    config = parse_config(TokenizerConfig, ["--health-port=50072"], env={})
    assert config.health_port == 50072
    assert parse_config(TokenizerConfig, [], env={"TOKENMILL_TOKENIZER_HEALTH_PORT": "7"}).health_port == 7
    assert parse_config(TokenizerConfig, [], env={}).health_port == -1
