"""A hostile local process against the executors of a real stack (``tokenmill up``'s launcher:
tokenizer, a prefill and a decode executor, drafter and scheduler as processes on loopback,
stories260K): loopback is no trust boundary.

- Without the deployment's internal secret, every RPC of the executors, the tokenizer and the
  drafter is UNAUTHENTICATED (health excepted: probes hold no secret).
- The secret is a file the launcher wrote private to its owner; no command line carries it.
- With the secret, ReadKVBlocks serves no block the scheduler did not grant for a hand-off in
  flight (PERMISSION_DENIED), and PullKVBlocks connects to no address outside the executor's
  --kv-peers (PERMISSION_DENIED, and the named listener sees no connection).

The disaggregated hand-off itself (the decode executor pulling a prompt's KV from the prefill
executor, with the secret) is tested on real processes in tests/stack/test_disaggregation.py;
the plaintext-but-authenticated hand-off runs here once too.
"""

from __future__ import annotations

import asyncio
import stat
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.internal_secret import METADATA_KEY
from services.common.pb.tokenmill.v1 import (
    drafter_pb2,
    executor_pb2,
    executor_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.common.server import create_channel
from services.stack.client import build_request
from services.stack.launcher import LaunchConfig, Launcher
from tests.helpers.service_harness import REPO_ROOT, STORIES_DIR, final_status
from tests.helpers.stack_streams import record_stream

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

EXECUTOR_FLAGS = ["--dtype=fp32", "--device=cpu", "--attention-backend=torch", "--num-blocks=64", "--block-size=16",
                  "--skip-warmup"]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def launcher(tmp_path_factory) -> AsyncIterator[Launcher]:
    launcher = Launcher(LaunchConfig(
        model=str(STORIES_DIR), public_port=0, executor_roles=["prefill", "decode"], executor_args=EXECUTOR_FLAGS,
        log_dir=str(tmp_path_factory.mktemp("hostile_executors")), start_timeout_s=120, restart=False,
        env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}))
    await asyncio.to_thread(launcher.start)
    try:
        yield launcher
    finally:
        await asyncio.to_thread(launcher.stop)


def secret_of(launcher: Launcher) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, launcher.secret_file.read_text().strip()),)


def every_method(channel: grpc.aio.Channel, pb2, service: str, metadata=None) -> dict:
    """Each method of ``service``, called with an empty message (raw bytes: no stub to keep up to
    date, so a method added later is covered too)."""
    calls = {}
    for method in pb2.DESCRIPTOR.services_by_name[service].methods:
        path = f"/{method.containing_service.full_name}/{method.name}"
        kind = ("stream" if method.client_streaming else "unary") + "_" + (
            "stream" if method.server_streaming else "unary")
        callable_ = getattr(channel, kind)(path)
        request = iter([b""]) if method.client_streaming else b""
        calls[method.name] = callable_(request, timeout=5, metadata=metadata)
    return calls


async def test_no_internal_rpc_answers_a_caller_without_the_secret(launcher) -> None:
    wrong = ((METADATA_KEY, "x" * 64),)
    backends = [(launcher.services[name].address, executor_pb2, "Executor") for name in launcher.executor_names]
    backends += [(launcher.services["tokenizer"].address, tokenizer_pb2, "Tokenizer"),
                 (launcher.services["drafter"].address, drafter_pb2, "Drafter")]
    for address, pb2, service in backends:
        async with create_channel(address) as channel:
            for metadata in (None, wrong):
                calls = every_method(channel, pb2, service, metadata)
                assert len(calls) >= 2
                for name, call in calls.items():
                    assert await final_status(call) == grpc.StatusCode.UNAUTHENTICATED, (address, name, metadata)
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    async with create_channel(launcher.services["tokenizer"].address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        reply = await stub.Encode(tokenizer_pb2.EncodeRequest(text="hi"), timeout=5, metadata=secret_of(launcher))
        assert list(reply.token_ids)


async def test_the_secret_is_a_private_file_and_on_no_command_line(launcher) -> None:
    assert stat.S_IMODE(launcher.secret_file.stat().st_mode) == 0o600
    secret = launcher.secret_file.read_text().strip()
    assert len(secret) >= 32
    for svc in launcher.services.values():
        cmdline = (await asyncio.to_thread(open(f"/proc/{svc.process.pid}/cmdline", "rb").read)).decode()
        assert secret not in cmdline and str(launcher.secret_file) in cmdline, svc.name


async def test_the_disaggregated_hand_off_still_copies_with_the_secret(launcher) -> None:
    async with create_channel(launcher.public_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        prompt = "Once upon a time there was a little bird who sang" + " la" * 20
        record = await record_stream(stub, build_request(prompt, max_tokens=8, temperature=0.0, ignore_eos=True))
        assert record.code == grpc.StatusCode.OK and len(record.token_ids) == 8, record.details
        profile = await stub.GetProfile(generation_pb2.GetProfileRequest(), timeout=10)
        decode = {e.role: e for e in profile.executors}["decode"]
        assert (decode.kv_transfers, decode.kv_transfer_failures) == (1, 0)


async def test_with_the_secret_no_block_is_read_without_a_grant(launcher) -> None:
    prefill = launcher.services[launcher.executor_names[0]].address
    async with create_channel(prefill) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        info = await stub.GetExecutorInfo(executor_pb2.GetExecutorInfoRequest(), timeout=5,
                                          metadata=secret_of(launcher))
        for grant in ("", "forged-grant"):
            read = executor_pb2.ReadKVBlocksRequest(kv_layout=info.kv_layout, block_ids=[0, 1], grant=grant)
            assert await final_status(stub.ReadKVBlocks(read, timeout=5, metadata=secret_of(launcher))) == (
                grpc.StatusCode.PERMISSION_DENIED)
        # A grant for block 1 reads block 1 once, and nothing else.
        grant = (await stub.GrantKVBlocks(executor_pb2.GrantKVBlocksRequest(block_ids=[1]), timeout=5,
                                          metadata=secret_of(launcher))).grant
        wider = executor_pb2.ReadKVBlocksRequest(kv_layout=info.kv_layout, block_ids=[0, 1], grant=grant)
        assert await final_status(stub.ReadKVBlocks(wider, timeout=5, metadata=secret_of(launcher))) == (
            grpc.StatusCode.PERMISSION_DENIED)


async def test_with_the_secret_no_pull_reaches_an_address_outside_the_peers(launcher) -> None:
    connections = []
    listener = await asyncio.start_server(lambda reader, writer: connections.append(writer), "127.0.0.1", 0)
    bait = f"127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    prefill, decode = (launcher.services[name].address for name in launcher.executor_names)
    try:
        async with create_channel(decode) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            for source in (bait, decode, f"localhost:{bait.rsplit(':', 1)[1]}"):
                pull = executor_pb2.PullKVBlocksRequest(source_address=source, source_block_ids=[0], block_ids=[0],
                                                        grant="any")
                assert await final_status(stub.PullKVBlocks(pull, timeout=10, metadata=secret_of(launcher))) == (
                    grpc.StatusCode.PERMISSION_DENIED), source
            # Its peer, without a grant there: the peer refuses the read, nothing is written.
            pull = executor_pb2.PullKVBlocksRequest(source_address=prefill, source_block_ids=[0], block_ids=[0])
            assert await final_status(stub.PullKVBlocks(pull, timeout=10, metadata=secret_of(launcher))) == (
                grpc.StatusCode.PERMISSION_DENIED)
        await asyncio.sleep(0.2)
        assert connections == []
    finally:
        listener.close()
