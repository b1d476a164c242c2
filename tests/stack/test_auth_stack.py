"""Authentication on the public API, through real servers on loopback: tokens, tenant rules,
token budgets with a retry hint, aborts limited to one's own requests, open health and
reflection, the tenant on log lines and metrics, the token never logged."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
from prometheus_client import REGISTRY

from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.common.server import RunningServer, create_channel
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.executor.main import serve as serve_executor
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.main import serve as serve_scheduler
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import serve as serve_tokenizer
from tests.helpers.service_harness import SERVING, STORIES_DIR, health_status, reflected_services

pytestmark = pytest.mark.asyncio(loop_scope="module")

TENANTS = [
    {"token": "token-of-alpha-0123456789", "tenant": "alpha"},
    {"token": "token-of-beta-0123456789", "tenant": "beta", "max_priority": 0},
    {"token": "token-of-gamma-0123456789", "tenant": "gamma", "models": ["another-model"]},
    {"token": "token-of-delta-0123456789", "tenant": "delta", "tokens_per_minute": 19},
]
ALPHA, BETA, GAMMA, DELTA = (t["token"] for t in TENANTS)


@dataclass
class AuthStack:
    servers: list[RunningServer]
    stub: generation_pb2_grpc.GenerationStub
    channel: grpc.aio.Channel


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[AuthStack]:
    tokens_file = tmp_path_factory.mktemp("auth") / "tokens.json"
    tokens_file.write_text(json.dumps(TENANTS))
    tokens_file.chmod(0o600)
    model = str(STORIES_DIR)
    tokenizer = await serve_tokenizer(TokenizerConfig(port=0, model=model))
    executor = await serve_executor(ExecutorServiceConfig(port=0, executor=ExecutorConfig(
        model=model, num_blocks=64, dtype="fp32", device="cpu", attention_backend="torch")))
    scheduler = await serve_scheduler(SchedulerServiceConfig(
        port=0, executor_addresses=(executor.address,), tokenizer_addresses=(tokenizer.address,), connect_timeout_s=10,
        auth_tokens_file=str(tokens_file), metrics_port=0))
    async with create_channel(scheduler.address) as channel:
        yield AuthStack([scheduler, executor, tokenizer], generation_pb2_grpc.GenerationStub(channel), channel)
    for running in (scheduler, executor, tokenizer):
        await running.stop(grace=0)


def request(max_tokens: int = 4, priority: int = 0, text: str = "Once upon a time") -> generation_pb2.GenerateRequest:
    r = generation_pb2.GenerateRequest(text=text, priority=priority)
    r.sampling.temperature = 0.0
    r.stop.max_tokens = max_tokens
    r.stop.ignore_eos = True
    return r


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


async def generate(stack: AuthStack, token: str | None, r: generation_pb2.GenerateRequest):
    """(messages, code, details, trailers) of one call."""
    call = stack.stub.Generate(r, metadata=bearer(token) if token else None, timeout=30)
    messages = []
    try:
        async for message in call:
            messages.append(message)
        return messages, grpc.StatusCode.OK, "", await call.trailing_metadata()
    except grpc.aio.AioRpcError as error:
        return messages, error.code(), error.details(), error.trailing_metadata()


async def test_health_and_reflection_need_no_token(stack: AuthStack) -> None:
    assert await health_status(stack.channel) == SERVING
    assert await health_status(stack.channel, "tokenmill.v1.Generation") == SERVING
    assert "tokenmill.v1.Generation" in await reflected_services(stack.channel)


@pytest.mark.parametrize(("metadata", "details"), [
    (None, "missing credentials: send 'authorization: Bearer TOKEN' metadata"),
    ((("authorization", "Bearer not-a-known-token"),), "unknown or malformed bearer token"),
    ((("authorization", f"Basic {ALPHA}"),), "unknown or malformed bearer token"),
    ((("authorization", "Bearer " + ALPHA[:-1]),), "unknown or malformed bearer token"),
])
async def test_missing_or_unknown_tokens_are_unauthenticated(stack: AuthStack, metadata, details) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stack.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), metadata=metadata, timeout=10)
    assert (error.value.code(), error.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, details)
    call = stack.stub.Generate(request(), metadata=metadata, timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        [m async for m in call]
    assert (error.value.code(), error.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, details)


async def test_a_known_token_generates_and_its_tenant_is_logged_and_counted(stack: AuthStack, capfd) -> None:
    before = REGISTRY.get_sample_value("tokenmill:tenant_requests_total", {"tenant": "alpha", "finish_reason": "length"}) or 0
    messages, code, _, _ = await generate(stack, ALPHA, request(max_tokens=4))
    assert code == grpc.StatusCode.OK
    assert messages[-1].finished.usage.completion_tokens == 4
    after = REGISTRY.get_sample_value("tokenmill:tenant_requests_total", {"tenant": "alpha", "finish_reason": "length"})
    assert after == before + 1
    assert REGISTRY.get_sample_value("tokenmill:tenant_tokens_total", {"tenant": "alpha", "kind": "generation"}) >= 4
    logged = capfd.readouterr()
    lines = [line for line in (logged.out + logged.err).splitlines() if "request_finished" in line]
    assert lines and all("alpha" in line for line in lines)
    assert all(t["token"] not in logged.out + logged.err for t in TENANTS)


async def test_tenant_rules_are_permission_denied(stack: AuthStack) -> None:
    _, code, details, _ = await generate(stack, BETA, request(priority=-1))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details == ("tenant 'beta' may not ask for priority -1; its most urgent priority is max_priority=0 "
                       "(lower is served first)")
    _, code, _, _ = await generate(stack, BETA, request(priority=0))
    assert code == grpc.StatusCode.OK
    _, code, details, _ = await generate(stack, GAMMA, request())
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details == "tenant 'gamma' may not use model 'stories260K' (allowed: another-model)"


async def test_a_spent_token_budget_is_resource_exhausted_with_a_retry_hint(stack: AuthStack) -> None:
    # 5 prompt tokens + 10 generated of delta's 19 per minute; the next request reserves its
    # 5-token prompt and its max_tokens, which do not fit.
    messages, code, _, _ = await generate(stack, DELTA, request(max_tokens=10))
    assert code == grpc.StatusCode.OK and messages[0].started.prompt_tokens == 5
    _, code, details, trailers = await generate(stack, DELTA, request(max_tokens=1))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details.startswith("tenant 'delta' has used 15 of its tokens_per_minute=19; this request needs 6 more")
    pushback = dict(trailers)["grpc-retry-pushback-ms"]
    assert 0 < int(pushback) <= 60_000
    # Other tenants are not affected.
    _, code, _, _ = await generate(stack, ALPHA, request())
    assert code == grpc.StatusCode.OK


async def test_a_tenant_aborts_only_its_own_requests(stack: AuthStack) -> None:
    r = request(max_tokens=400)
    r.request_id = "alpha-long-request"
    call = stack.stub.Generate(r, metadata=bearer(ALPHA), timeout=60)
    first = await call.read()
    assert first.started.request_id == "alpha-long-request"
    other = await stack.stub.Abort(generation_pb2.AbortRequest(request_id="alpha-long-request"),
                                   metadata=bearer(BETA), timeout=10)
    assert not other.found
    own = await stack.stub.Abort(generation_pb2.AbortRequest(request_id="alpha-long-request"),
                                 metadata=bearer(ALPHA), timeout=10)
    assert own.found
    rest = []
    while (message := await call.read()) is not grpc.aio.EOF:
        rest.append(message)
    assert rest[-1].finished.finish_reason == common_pb2.FINISH_REASON_ABORT
