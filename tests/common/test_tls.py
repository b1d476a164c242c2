"""TLS on a real server on loopback (start_server with ServerTLS), certificates made here with
`cryptography` (services/stack/dev_ca.py): verified clients get in; plaintext clients, clients
trusting another CA and, under mTLS, clients without a certificate or with one from another CA
are refused; a reload (in process, and SIGHUP to a service process) serves new connections the
new certificate while an open stream keeps working; misconfigured TLS flags end a service at
start with exit 2 and one line naming the flag."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli.main import main as tokenmill
from services.common.server import RunningServer, create_channel, start_server
from services.common.tls import ClientTLS, ServerTLS
from services.stack.dev_ca import (
    DevCertificates,
    cert_pem,
    issue,
    key_pem,
    make_authority,
    write_dev_certificates,
    write_file,
)
from tests.helpers.service_harness import REPO_ROOT, wait_for_port_file

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WATCHED = "tokenmill.test.Watched"


@pytest.fixture
def pki(tmp_path: Path) -> DevCertificates:
    return write_dev_certificates(tmp_path / "pki")


@pytest.fixture
def other_pki(tmp_path: Path) -> DevCertificates:
    """Certificates from a second, unrelated CA (same names, same file layout)."""
    return write_dev_certificates(tmp_path / "other")


def client(pki: DevCertificates, *, ca: DevCertificates | None = None, cert: bool = True) -> ClientTLS:
    """Trust ``ca``'s CA (default: pki's), present pki's client certificate when ``cert``."""
    trusted = str((ca or pki).ca)
    return ClientTLS(trusted, str(pki.client_cert), str(pki.client_key)) if cert else ClientTLS(trusted)


def live_files(pki: DevCertificates, folder: Path, *, mtls: bool) -> ServerTLS:
    """Copies of pki's server files that a test may overwrite (a rotation), as a ServerTLS."""
    folder.mkdir()
    for name in ("server_cert", "server_key", "ca"):
        shutil.copyfile(getattr(pki, name), folder / getattr(pki, name).name)
    return ServerTLS(str(folder / pki.server_cert.name), str(folder / pki.server_key.name),
                     str(folder / pki.ca.name) if mtls else "")


def rotate(tls: ServerTLS, to: DevCertificates) -> None:
    shutil.copyfile(to.server_cert, tls.cert)
    shutil.copyfile(to.server_key, tls.key)
    if tls.client_ca:
        shutil.copyfile(to.ca, tls.client_ca)


async def start(tls: ServerTLS) -> RunningServer:
    return await start_server("tls-probe", lambda server: [WATCHED], port=0, tls=tls)


async def check(address: str, tls: ClientTLS | None) -> int:
    async with create_channel(address, tls=tls) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def refused(address: str, tls: ClientTLS | None) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await check(address, tls)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    return err.value.details()


@pytest.fixture
async def tls_server(pki: DevCertificates, tmp_path: Path) -> AsyncIterator[RunningServer]:
    running = await start(live_files(pki, tmp_path / "live", mtls=False))
    yield running
    await running.stop(grace=0)


@pytest.fixture
async def mtls_server(pki: DevCertificates, tmp_path: Path) -> AsyncIterator[RunningServer]:
    running = await start(live_files(pki, tmp_path / "live", mtls=True))
    yield running
    await running.stop(grace=0)


async def test_tls_server_answers_a_client_that_verifies_it(tls_server, pki) -> None:
    assert await check(tls_server.address, ClientTLS(str(pki.ca))) == SERVING
    # The certificate names localhost as well as 127.0.0.1.
    assert await check(f"localhost:{tls_server.port}", ClientTLS(str(pki.ca))) == SERVING


async def test_tls_server_refuses_plaintext_and_is_refused_by_a_client_trusting_another_ca(
        tls_server, other_pki) -> None:
    await refused(tls_server.address, None)
    await refused(tls_server.address, ClientTLS(str(other_pki.ca)))


async def test_mtls_requires_a_client_certificate_from_its_ca(mtls_server, pki, other_pki) -> None:
    assert await check(mtls_server.address, client(pki)) == SERVING
    await refused(mtls_server.address, client(pki, cert=False))  # no client certificate
    await refused(mtls_server.address, client(other_pki, ca=pki))  # a certificate from another CA
    await refused(mtls_server.address, None)


async def test_reload_serves_new_connections_the_new_certificate_and_keeps_open_streams(
        mtls_server, pki, other_pki) -> None:
    async with create_channel(mtls_server.address, tls=client(pki)) as old:
        watch = health_pb2_grpc.HealthStub(old).Watch(health_pb2.HealthCheckRequest(service=WATCHED), timeout=30)
        assert (await watch.read()).status == SERVING

        # Rotate: the server certificate and the client CA now come from the other CA.
        rotate(mtls_server.tls.tls, other_pki)
        await refused(mtls_server.address, client(other_pki))  # not reloaded yet: the old certificate
        assert mtls_server.reload_tls()

        assert await check(mtls_server.address, client(other_pki)) == SERVING
        await refused(mtls_server.address, client(pki))  # the old CA, on both sides
        await refused(mtls_server.address, client(other_pki, cert=False))
        assert mtls_server.tls.reloads == 1

        # The stream opened before the rotation goes on, on its old connection.
        await mtls_server.health.set(WATCHED, NOT_SERVING)
        assert (await watch.read()).status == NOT_SERVING
        reply = await health_pb2_grpc.HealthStub(old).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == SERVING
        watch.cancel()


async def test_a_bad_reload_keeps_the_current_certificate(tls_server, pki, other_pki) -> None:
    shutil.copyfile(other_pki.server_key, tls_server.tls.tls.key)  # a key that is not the certificate's
    assert not tls_server.reload_tls()
    assert await check(tls_server.address, ClientTLS(str(pki.ca))) == SERVING


async def test_create_channel_reads_the_client_files_when_called(mtls_server, pki, tmp_path) -> None:
    # A link that reconnects after its client certificate was rotated presents the new one.
    rotating = ClientTLS(str(pki.ca), str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))
    authority = make_authority("a CA the server does not trust")
    stale_cert, stale_key = issue(authority, "stale client", server=False, client=True)
    write_file(tmp_path / "c.pem", cert_pem(stale_cert))
    write_file(tmp_path / "k.pem", key_pem(stale_key), private=True)
    await refused(mtls_server.address, rotating)
    shutil.copyfile(pki.client_cert, tmp_path / "c.pem")
    shutil.copyfile(pki.client_key, tmp_path / "k.pem")
    assert await check(mtls_server.address, rotating) == SERVING


# --- a service process: SIGHUP ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_sighup_reloads_a_service_process_certificate(pki, other_pki, tmp_path) -> None:
    port_file = tmp_path / "drafter.port"
    live = live_files(pki, tmp_path / "live", mtls=True)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.drafter", "--port", "0", "--port-file", str(port_file),
        "--tls-cert", live.cert, "--tls-key", live.key, "--tls-client-ca", live.client_ca,
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        address = f"127.0.0.1:{await wait_for_port_file(port_file, proc)}"
        async with create_channel(address, tls=client(pki)) as old:
            watch = health_pb2_grpc.HealthStub(old).Watch(health_pb2.HealthCheckRequest(), timeout=60)
            assert (await watch.read()).status == SERVING
            rotate(ServerTLS(live.cert, live.key), other_pki)  # the server certificate only
            proc.send_signal(signal.SIGHUP)
            new_ca = client(pki, ca=other_pki)  # the client certificate is still pki's, as the client CA is
            deadline = asyncio.get_running_loop().time() + 10
            while True:  # the signal is handled asynchronously: retry until the new certificate is served
                try:
                    assert await check(address, new_ca) == SERVING
                    break
                except grpc.aio.AioRpcError:
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.1)
            await refused(address, client(pki))  # trusting the old CA only
            reply = await health_pb2_grpc.HealthStub(old).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == SERVING and proc.returncode is None
            watch.cancel()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=15) == 0
        assert b'"tls_reloaded"' in await proc.stderr.read()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# --- misconfiguration: exit 2 at start, naming the flag -------------------------------------------


def misconfigurations(pki: DevCertificates, other: DevCertificates, tmp: Path) -> list[tuple[str, list[str], str]]:
    garbage = tmp / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cert, key, ca = str(pki.server_cert), str(pki.server_key), str(pki.ca)
    return [
        ("tokenizer", ["--tls-cert", cert], "--tls-cert needs --tls-key"),
        ("drafter", ["--tls-key", key], "--tls-key needs --tls-cert"),
        ("drafter", ["--tls-client-ca", ca], "--tls-client-ca needs --tls-cert and --tls-key"),
        ("tokenizer", ["--tls-cert", "/nonexistent/cert.pem", "--tls-key", key],
         "--tls-cert /nonexistent/cert.pem: cannot read it: No such file or directory"),
        ("drafter", ["--tls-cert", str(garbage), "--tls-key", key], f"--tls-cert {garbage}: not a PEM certificate"),
        ("drafter", ["--tls-cert", cert, "--tls-key", cert], f"--tls-key {cert}: not an unencrypted PEM private key"),
        ("scheduler", ["--tls-cert", cert, "--tls-key", str(other.server_key)],
         f"--tls-key {other.server_key}: not the key of the certificate in --tls-cert {cert}"),
        ("tokenizer", ["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", "/nonexistent/ca.pem"],
         "--tls-client-ca /nonexistent/ca.pem: cannot read it: No such file or directory"),
        ("scheduler", ["--backend-tls-cert", str(pki.client_cert)], "--backend-tls-cert needs --backend-tls-key"),
        ("scheduler", ["--backend-tls-ca", str(garbage)], f"--backend-tls-ca {garbage}: not a PEM certificate"),
        ("scheduler", ["--backend-tls-cert", str(pki.client_cert), "--backend-tls-key", str(other.client_key)],
         f"--backend-tls-key {other.client_key}: not the key of the certificate in --backend-tls-cert "
         f"{pki.client_cert}"),
    ]


def test_tls_misconfiguration_ends_the_service_at_start_naming_the_flag(pki, other_pki, tmp_path, capsys) -> None:
    for service, argv, message in misconfigurations(pki, other_pki, tmp_path):
        assert tokenmill(["serve", service, "--port", "0", *argv]) == 2, (service, argv)
        assert capsys.readouterr().err.strip() == f"tokenmill serve {service}: error: {message}"


def test_tls_settings_come_from_the_environment_too(pki, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TOKENMILL_EXECUTOR_TLS_CERT", str(pki.server_cert))
    assert tokenmill(["serve", "executor", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == "tokenmill serve executor: error: --tls-cert needs --tls-key"


def test_a_misconfigured_service_process_exits_2_before_it_binds(pki, tmp_path) -> None:
    import subprocess

    port_file = tmp_path / "port"
    done = subprocess.run([sys.executable, "-m", "services.tokenizer", "--port", "0", "--port-file", str(port_file),
                           "--tls-cert", str(pki.server_cert)], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "tokenmill serve tokenizer: error: --tls-cert needs --tls-key"
    assert not port_file.exists()
