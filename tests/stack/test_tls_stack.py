"""The stack with mTLS on every hop, in this process on loopback: the tokenizer and executor
require the scheduler's client certificate, the scheduler verifies theirs and requires one from
its own clients. Greedy streams equal those of the same stack without TLS; a scheduler that
does not present the client certificate, or speaks plaintext, cannot reach its backends; a
plaintext or certificate-less client is refused by the public API; a client holding the public
API's certificate (signed by the same CA) is refused by the backends, which take the scheduler's
alone (--tls-allowed-clients); `tokenmill generate` reaches it with --tls-ca/--tls-cert/--tls-key
or the TOKENMILL_TLS_* variables."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
import structlog

from services.common.errors import UnavailableError
from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc, generation_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.common.server import RunningServer, create_channel
from services.common.tls import ClientTLS
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.executor.main import serve as serve_executor
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.main import serve as serve_scheduler
from services.stack.dev_ca import EXECUTOR_IDENTITY, SCHEDULER_IDENTITY, DevCertificates, write_dev_certificates
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import serve as serve_tokenizer
from tests.helpers.service_harness import STORIES_DIR
from tests.helpers.stack_streams import assert_framed, greedy_request, record_stream

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = str(STORIES_DIR)
EXECUTOR_FLAGS = dict(num_blocks=256, dtype="fp32", device="cpu", attention_backend="torch")
PROMPTS = ["Once upon a time", "The cat", "你好", "🙂 hi", [1, 403, 261, 300, 79]]
MAX_TOKENS = 20


@dataclass
class Stack:
    servers: list[RunningServer]
    tokenizer: RunningServer
    executor: RunningServer
    scheduler: RunningServer
    channel: grpc.aio.Channel

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)


def backend_server_flags(pki: DevCertificates | None) -> dict:
    """A backend's: mTLS, and only the scheduler's certificate may call it."""
    flags = server_flags(pki)
    return {**flags, "tls_allowed_clients": (SCHEDULER_IDENTITY,)} if pki is not None else flags


def executor_server_flags(pki: DevCertificates | None) -> dict:
    """An executor's: a backend's, with the other executors' certificate for ReadKVBlocks, which
    it presents itself when it pulls KV from one (launcher.py does the same)."""
    flags = backend_server_flags(pki)
    if pki is None:
        return flags
    return {**flags, "tls_peer_clients": (EXECUTOR_IDENTITY,), "backend_tls_ca": str(pki.ca),
            "backend_tls_cert": str(pki.executor_cert), "backend_tls_key": str(pki.executor_key)}


def server_flags(pki: DevCertificates | None) -> dict[str, str]:
    if pki is None:
        return {}
    return dict(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca))


def backend_flags(pki: DevCertificates) -> dict[str, str]:
    return dict(backend_tls_ca=str(pki.ca), backend_tls_cert=str(pki.scheduler_cert),
                backend_tls_key=str(pki.scheduler_key))


def client_tls(pki: DevCertificates) -> ClientTLS:
    return ClientTLS(str(pki.ca), str(pki.client_cert), str(pki.client_key))


async def start_stack(pki: DevCertificates | None) -> Stack:
    tokenizer = await serve_tokenizer(TokenizerConfig(port=0, model=MODEL, **backend_server_flags(pki)))
    executor = await serve_executor(ExecutorServiceConfig(port=0, executor=ExecutorConfig(model=MODEL, **EXECUTOR_FLAGS),
                                                          **executor_server_flags(pki)))
    scheduler = await serve_scheduler(SchedulerServiceConfig(
        port=0, executor_addresses=(executor.address,), tokenizer_addresses=(tokenizer.address,), connect_timeout_s=10,
        **server_flags(pki), **(backend_flags(pki) if pki else {})))
    channel = create_channel(scheduler.address, tls=client_tls(pki) if pki else None)
    return Stack([scheduler, executor, tokenizer], tokenizer, executor, scheduler, channel)


@pytest.fixture
def quiet_servers():
    """The servers in this process log to the stdout the CLI under test prints to: errors only."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> DevCertificates:
    return write_dev_certificates(tmp_path_factory.mktemp("pki"))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stacks(pki) -> AsyncIterator[tuple[Stack, Stack]]:
    secure, plain = await start_stack(pki), await start_stack(None)
    yield secure, plain
    for stack in (secure, plain):
        await stack.channel.close()
        for running in stack.servers:
            await running.stop(grace=0)


async def test_mtls_stack_generates_what_the_plaintext_stack_does(stacks) -> None:
    secure, plain = stacks
    assert all(s.tls is not None and s.tls.tls.client_ca for s in secure.servers)
    assert all(s.tls is None for s in plain.servers)
    for prompt in PROMPTS:
        over_tls = await record_stream(secure.stub, greedy_request(prompt, MAX_TOKENS))
        in_clear = await record_stream(plain.stub, greedy_request(prompt, MAX_TOKENS))
        assert_framed(over_tls, prompt_tokens=in_clear.started.prompt_tokens)
        assert len(over_tls.token_ids) == MAX_TOKENS
        assert (over_tls.token_ids, over_tls.text) == (in_clear.token_ids, in_clear.text)


async def test_the_public_api_refuses_plaintext_and_certificate_less_clients(stacks, pki) -> None:
    secure, _ = stacks
    for tls in (None, ClientTLS(str(pki.ca))):
        async with create_channel(secure.scheduler.address, tls=tls) as channel:
            record = await record_stream(generation_pb2_grpc.GenerationStub(channel), greedy_request("Hi", 2),
                                         timeout=5)
        assert record.code == grpc.StatusCode.UNAVAILABLE and not record.messages, record.details


@pytest.mark.parametrize("backend", [
    pytest.param(lambda pki: {}, id="plaintext"),
    pytest.param(lambda pki: dict(backend_tls_ca=str(pki.ca)), id="no-client-certificate"),
    pytest.param(lambda pki: dict(backend_tls_ca=str(pki.server_cert.parent / "wrong-ca.pem"),
                                  backend_tls_cert=str(pki.client_cert), backend_tls_key=str(pki.client_key)),
                 id="wrong-ca"),
])
async def test_a_scheduler_that_does_not_do_mtls_cannot_reach_the_backends(stacks, pki, backend) -> None:
    secure, _ = stacks
    wrong_ca = pki.server_cert.parent / "wrong-ca.pem"
    if not wrong_ca.exists():  # a CA that did not sign the backends' certificates
        wrong_ca.write_bytes(write_dev_certificates(pki.folder.parent / "wrong").ca.read_bytes())
    with pytest.raises(UnavailableError, match="did not become reachable"):
        await serve_scheduler(SchedulerServiceConfig(
            port=0, executor_addresses=(secure.executor.address,), tokenizer_addresses=(secure.tokenizer.address,),
            connect_timeout_s=1.5, **backend(pki)))


async def test_tokenmill_generate_reaches_the_mtls_stack_with_flags_or_environment(stacks, pki, capsys,
                                                                                 monkeypatch, quiet_servers) -> None:
    from services.cli.generate import main as generate_main

    def printed() -> str:
        return capsys.readouterr().out

    secure, plain = stacks
    common = ["Once upon a time", "--temperature", "0", "--max-tokens", "12", "--ignore-eos"]
    assert await asyncio.to_thread(generate_main, [*common, "--address", plain.scheduler.address]) == 0
    expected = printed()
    assert expected.startswith("Once upon a time") and len(expected) > len("Once upon a time\n")

    flags = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    assert await asyncio.to_thread(generate_main, [*common, "--address", secure.scheduler.address, *flags]) == 0
    assert printed() == expected

    for name, value in zip(("TOKENMILL_TLS_CA", "TOKENMILL_TLS_CERT", "TOKENMILL_TLS_KEY"), flags[1::2]):
        monkeypatch.setenv(name, value)
    assert await asyncio.to_thread(generate_main, [*common, "--address", secure.scheduler.address]) == 0
    assert printed() == expected

    monkeypatch.setenv("TOKENMILL_TLS_CA", "/nonexistent/ca.pem")
    assert await asyncio.to_thread(generate_main, [*common, "--address", secure.scheduler.address]) == 2
    assert capsys.readouterr().err.strip() == (
        "tokenmill generate: error: --tls-ca /nonexistent/ca.pem: cannot read it: No such file or directory")


async def test_the_public_client_certificate_cannot_drive_a_backend(stacks, pki) -> None:
    # The CA signed it, so the TLS handshake passes; the backends serve only the scheduler.
    secure, _ = stacks
    user = ClientTLS(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    async with create_channel(secure.executor.address, tls=user) as channel:
        step = executor_pb2_grpc.ExecutorStub(channel).Step(iter([executor_pb2.StepRequest(step_id=1)]), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [reply async for reply in step]
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await executor_pb2_grpc.ExecutorStub(channel).GetExecutorInfo(executor_pb2.GetExecutorInfoRequest(),
                                                                          timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with create_channel(secure.tokenizer.address, tls=user) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await tokenizer_pb2_grpc.TokenizerStub(channel).Encode(tokenizer_pb2.EncodeRequest(text="hi"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    scheduler = ClientTLS(str(pki.ca), str(pki.scheduler_cert), str(pki.scheduler_key))
    async with create_channel(secure.tokenizer.address, tls=scheduler) as channel:
        reply = await tokenizer_pb2_grpc.TokenizerStub(channel).Encode(tokenizer_pb2.EncodeRequest(text="hi"), timeout=5)
        assert list(reply.token_ids)


async def test_executors_read_each_others_kv_blocks_and_nothing_else(stacks, pki) -> None:
    # A second executor pulls blocks from the stack's over mTLS with the executors' certificate;
    # that certificate opens ReadKVBlocks alone, and the user's not even that.
    secure, _ = stacks
    peer = await serve_executor(ExecutorServiceConfig(port=0, executor=ExecutorConfig(model=MODEL, **EXECUTOR_FLAGS),
                                                      kv_peers=(secure.executor.address,),
                                                      **executor_server_flags(pki)))
    scheduler = ClientTLS(str(pki.ca), str(pki.scheduler_cert), str(pki.scheduler_key))
    executor = ClientTLS(str(pki.ca), str(pki.executor_cert), str(pki.executor_key))
    user = ClientTLS(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    try:
        async with create_channel(secure.executor.address, tls=scheduler) as channel:
            source = executor_pb2_grpc.ExecutorStub(channel)
            layout = (await source.GetExecutorInfo(executor_pb2.GetExecutorInfoRequest(), timeout=5)).kv_layout
            grants = [(await source.GrantKVBlocks(executor_pb2.GrantKVBlocksRequest(block_ids=ids), timeout=5)).grant
                      for ids in ([3, 4], [0], [0])]
        async with create_channel(peer.address, tls=scheduler) as channel:
            pulled = await executor_pb2_grpc.ExecutorStub(channel).PullKVBlocks(executor_pb2.PullKVBlocksRequest(
                source_address=secure.executor.address, source_block_ids=[3, 4], block_ids=[0, 1], grant=grants[0]),
                timeout=30)
            assert pulled.num_blocks == 2 and pulled.num_bytes > 0
        read = executor_pb2.ReadKVBlocksRequest(kv_layout=layout, block_ids=[0], grant=grants[1])
        async with create_channel(secure.executor.address, tls=executor) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            assert [chunk.count async for chunk in stub.ReadKVBlocks(read, timeout=10)] == [1]
            for call in (lambda: stub.GetExecutorInfo(executor_pb2.GetExecutorInfoRequest(), timeout=5),
                         lambda: stub.GrantKVBlocks(executor_pb2.GrantKVBlocksRequest(block_ids=[0]), timeout=5),
                         lambda: stub.PullKVBlocks(executor_pb2.PullKVBlocksRequest(
                             source_address=peer.address, source_block_ids=[0], block_ids=[0]), timeout=5)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call()
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            step = stub.Step(iter([executor_pb2.StepRequest(step_id=1)]), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [reply async for reply in step]
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        async with create_channel(secure.executor.address, tls=user) as channel:
            read.grant = grants[2]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [chunk async for chunk in executor_pb2_grpc.ExecutorStub(channel).ReadKVBlocks(read, timeout=5)]
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await peer.stop(grace=0)
