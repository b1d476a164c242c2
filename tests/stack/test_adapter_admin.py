"""The scheduler's Admin API for LoRA adapters, through real servers on loopback: two executors
(one with a smaller --max-lora-rank), tenants from an auth tokens file. Loads fan out to every
executor or to none, bad input is refused naming the field and the limit, only an admin tenant
may call it, and requests see the set change. Loads name adapters inside --lora-dir only (the
scheduler and each executor check), and without it they are refused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio

from services.common.internal_secret import call_metadata
from services.common.pb.tokenmill.v1 import (
    admin_pb2, admin_pb2_grpc, executor_pb2, executor_pb2_grpc, generation_pb2, generation_pb2_grpc)
from services.common.server import RunningServer, create_channel
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.executor.main import serve as serve_executor
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.main import serve as serve_scheduler
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import serve as serve_tokenizer
from tests.helpers.lora_adapters import write_adapter, write_adapter_set, write_private_json
from tests.helpers.service_harness import STORIES_DIR
from tests.helpers.stack_streams import greedy_request

pytestmark = pytest.mark.asyncio(loop_scope="module")

USER, OPS = "token-of-a-user-0123456789", "token-of-ops-0123456789"
TENANTS = [{"token": USER, "tenant": "user"}, {"token": OPS, "tenant": "ops", "admin": True}]


@dataclass
class AdminStack:
    servers: list[RunningServer]
    channel: grpc.aio.Channel
    executors: list[str]
    adapters: dict[str, str]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[AdminStack]:
    root = tmp_path_factory.mktemp("admin")
    tokens = write_private_json(root / "tokens.json", TENANTS)
    outside = write_adapter(tmp_path_factory.mktemp("elsewhere") / "secret", rank=4)
    (root / "link").symlink_to(outside, target_is_directory=True)
    adapters = {**write_adapter_set(root), "outside": str(outside)}
    model = str(STORIES_DIR)
    tokenizer = await serve_tokenizer(TokenizerConfig(port=0, model=model, allow_unauthenticated=True))
    executors = [await serve_executor(ExecutorServiceConfig(port=0, allow_unauthenticated=True, executor=ExecutorConfig(
        model=model, num_blocks=64, dtype="fp32", device="cpu", attention_backend="torch", max_loras=2,
        max_lora_rank=rank, lora_dir=str(root)))) for rank in (8, 4)]
    scheduler = await serve_scheduler(SchedulerServiceConfig(
        port=0, executor_addresses=tuple(e.address for e in executors), tokenizer_addresses=(tokenizer.address,),
        connect_timeout_s=10, auth_tokens_file=str(tokens), allow_unauthenticated=True, lora_dir=str(root)))
    async with create_channel(scheduler.address) as channel:
        yield AdminStack([scheduler, *executors, tokenizer], channel, [e.address for e in executors], adapters)
    for running in (scheduler, *executors, tokenizer):
        await running.stop(grace=0)


def as_(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def executor_adapters(address: str) -> list[str]:
    async with create_channel(address) as channel:
        info = await executor_pb2_grpc.ExecutorStub(channel).GetExecutorInfo(executor_pb2.GetExecutorInfoRequest(),
                                                                            metadata=call_metadata(""))
    return sorted(a.name for a in info.adapters)


async def generate(stack: AdminStack, adapter: str) -> grpc.StatusCode:
    request = greedy_request("Once upon a time", 4)
    request.adapter = adapter
    call = generation_pb2_grpc.GenerationStub(stack.channel).Generate(request, metadata=as_(USER), timeout=60)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def test_only_an_admin_tenant_may_call_it(stack):
    admin = admin_pb2_grpc.AdminStub(stack.channel)
    error = await refused(admin.ListAdapters(admin_pb2.ListAdaptersRequest()))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    error = await refused(admin.LoadAdapter(admin_pb2.AdminLoadAdapterRequest(name="r4", path=stack.adapters["r4"]),
                                            metadata=as_(USER)))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "tenant 'user' may not call the Admin API" in error.details() and '"admin": true' in error.details()
    assert await executor_adapters(stack.executors[0]) == []


async def test_load_serve_refuse_and_unload(stack):
    admin = admin_pb2_grpc.AdminStub(stack.channel)
    load = lambda name, path, replace=False: admin.LoadAdapter(  # noqa: E731
        admin_pb2.AdminLoadAdapterRequest(name=name, path=path, replace=replace), metadata=as_(OPS))
    info = await load("r4", stack.adapters["r4"])
    assert (info.name, info.rank, info.path) == ("r4", 4, stack.adapters["r4"])
    assert [await executor_adapters(a) for a in stack.executors] == [["r4"], ["r4"]]
    assert await generate(stack, "r4") == grpc.StatusCode.OK
    # The public model info lists it, without where it lies.
    model_info = await generation_pb2_grpc.GenerationStub(stack.channel).GetModelInfo(
        generation_pb2.GetModelInfoRequest(), metadata=as_(USER))
    assert [(a.name, a.rank, a.path) for a in model_info.adapters] == [("r4", 4, "")]

    clash = await refused(load("r4", stack.adapters["r2"]))
    assert clash.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "name: an adapter named 'r4' is already loaded" in clash.details() and "replace=true" in clash.details()
    replaced = await load("r4", stack.adapters["r2"], replace=True)
    assert replaced.fingerprint != info.fingerprint and list(replaced.target_modules) == ["o_proj"]

    # Rank 8 fits the first executor (max 8) but not the second (max 4): refused, and the first
    # drops it again.
    too_big = await refused(load("r8", stack.adapters["r8"]))
    assert too_big.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "field r: rank 8 exceeds max_lora_rank=4" in too_big.details(), too_big.details()
    assert [await executor_adapters(a) for a in stack.executors] == [["r4"], ["r4"]]
    assert await generate(stack, "r8") == grpc.StatusCode.NOT_FOUND

    missing = await refused(load("x", "no-such-adapter"))
    assert missing.code() == grpc.StatusCode.INVALID_ARGUMENT and "is not a directory" in missing.details()
    bad_name = await refused(load("-x", stack.adapters["r4"]))
    assert bad_name.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_name.details().startswith("name: adapter name")
    no_path = await refused(load("x", ""))
    assert no_path.code() == grpc.StatusCode.INVALID_ARGUMENT and "MAX_ADAPTER_PATH_CHARS" in no_path.details()

    unknown = await refused(admin.UnloadAdapter(admin_pb2.AdminUnloadAdapterRequest(name="nope"), metadata=as_(OPS)))
    assert unknown.code() == grpc.StatusCode.NOT_FOUND and "(loaded: r4)" in unknown.details()
    await admin.UnloadAdapter(admin_pb2.AdminUnloadAdapterRequest(name="r4"), metadata=as_(OPS))
    assert (await admin.ListAdapters(admin_pb2.ListAdaptersRequest(), metadata=as_(OPS))).adapters == []
    assert [await executor_adapters(a) for a in stack.executors] == [[], []]
    assert await generate(stack, "r4") == grpc.StatusCode.NOT_FOUND
    # A name no load could have given is malformed, not missing (found by make fuzz).
    assert await generate(stack, "\x08\x03") == grpc.StatusCode.INVALID_ARGUMENT


async def test_loads_only_from_inside_the_lora_dir(stack):
    admin = admin_pb2_grpc.AdminStub(stack.channel)
    load = lambda path: admin.LoadAdapter(  # noqa: E731
        admin_pb2.AdminLoadAdapterRequest(name="x", path=path), metadata=as_(OPS))
    for path in ("../elsewhere0/secret", stack.adapters["outside"], "link", "r4/../..", str(STORIES_DIR)):
        error = await refused(load(path))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, error.details())
        assert error.details().startswith("path: ") and "outside the adapter directory --lora-dir=" in error.details()
    # The executor checks again (a caller that reaches it past the scheduler).
    async with create_channel(stack.executors[0]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as escaped:
            await executor_pb2_grpc.ExecutorStub(channel).LoadAdapter(
                executor_pb2.LoadAdapterRequest(name="x", path="link"), metadata=call_metadata(""))
    assert escaped.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the adapter directory" in escaped.value.details()
    assert [await executor_adapters(a) for a in stack.executors] == [[], []]
    # A relative name inside it loads.
    info = await load("r4")
    assert info.path == stack.adapters["r4"] and info.rank == 4
    await admin.UnloadAdapter(admin_pb2.AdminUnloadAdapterRequest(name="x"), metadata=as_(OPS))


async def test_without_a_lora_dir_loading_while_serving_is_refused(stack, tmp_path):
    """The scheduler refuses before any executor is asked (this one would take it), and an
    executor without --lora-dir refuses a caller that reaches it directly."""
    adapter = str(write_adapter(tmp_path / "r4", rank=4))
    executors = [await serve_executor(ExecutorServiceConfig(
        port=0, allow_unauthenticated=True, skip_warmup=True, executor=ExecutorConfig(
            model=str(STORIES_DIR), num_blocks=64, dtype="fp32", device="cpu", attention_backend="torch", max_loras=2,
            lora_dir=lora_dir))) for lora_dir in (str(tmp_path), "")]
    scheduler = await serve_scheduler(SchedulerServiceConfig(
        port=0, executor_addresses=(executors[0].address,), tokenizer_addresses=(stack.servers[-1].address,),
        connect_timeout_s=10, allow_unauthenticated=True))
    try:
        async with create_channel(scheduler.address) as channel:
            error = await refused(admin_pb2_grpc.AdminStub(channel).LoadAdapter(
                admin_pb2.AdminLoadAdapterRequest(name="r4", path=adapter)))
        assert await executor_adapters(executors[0].address) == []
        async with create_channel(executors[1].address) as channel:
            direct = await refused(executor_pb2_grpc.ExecutorStub(channel).LoadAdapter(
                executor_pb2.LoadAdapterRequest(name="r4", path=adapter), metadata=call_metadata("")))
        async with create_channel(executors[0].address) as channel:  # the same load where it is allowed
            await executor_pb2_grpc.ExecutorStub(channel).LoadAdapter(
                executor_pb2.LoadAdapterRequest(name="r4", path="r4"), metadata=call_metadata(""))
    finally:
        await scheduler.stop(grace=0)
        for executor in executors:
            await executor.stop(grace=0)
    for refusal in (error, direct):
        assert refusal.code() == grpc.StatusCode.FAILED_PRECONDITION, refusal.details()
        assert "--lora-dir (TOKENMILL_LORA_DIR)" in refusal.details()
