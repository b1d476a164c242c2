"""Per-key and per-target rate limits on the gateway run as a process (``--api-keys-file`` typed on
its command line) in front of a real stories260K engine, seen through the official ``openai`` and
``anthropic`` clients (``max_retries=0``: both retry a 429 by default) and the gRPC intake:

- a key over its ``requests_per_minute`` gets 429 with ``retry-after`` in seconds on chat,
  completions, Responses (OpenAI's envelope), Messages (Anthropic's, streamed too), Messages'
  count_tokens and gRPC (RESOURCE_EXHAUSTED with its retry pushback);
- ``tokens_per_minute`` counts the prompt: a request that used its whole reservation plus a long
  prompt leaves the next one waiting, where its max_tokens alone would have fit; a max_tokens
  over a minute's tokens is 400 naming it; /metrics counts each key's tokens under its tenant
  exactly as the usage the client got, and never shows a key;
- a target at its limit is passed over for the route's next (``x-tokenmill-target`` says which),
  and with both at theirs the request is 429.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import grpc
import httpx2 as httpx
import openai
import pytest
import pytest_asyncio

from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import RunningServer, create_channel
from services.gateway.intake import MODEL_HEADER
from tests.helpers.gateway_process import GatewayProcess, start_gateway
from tests.helpers.gateway_stack import serve_engine, stop_all, stories_with_chat_template, write_routes

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

MODEL, LIMITED = "stories", "limited"
ONE_A_MINUTE = {name: f"sk-{name}-0123456789" for name in ("chat", "completions", "responses", "messages", "count",
                                                            "grpc")}
TOKENS_KEY, OPEN_KEY = "sk-tokens-0123456789", "sk-open-0123456789"
LONG_PROMPT = "Once upon a time there was a little girl named Lily. She liked to play in the park. " * 6


@dataclass
class Stack:
    root: Path
    engine: list[RunningServer]
    gateway: GatewayProcess

    def openai(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.gateway.base}/v1", api_key=key, max_retries=0, timeout=60)

    async def metrics(self) -> str:
        async with httpx.AsyncClient(base_url=self.gateway.base, timeout=10) as client:
            return (await client.get("/metrics")).text


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[Stack]:
    root = tmp_path_factory.mktemp("rate-limits")
    engine = await serve_engine(model=stories_with_chat_template(root))
    address = engine[-1].address
    write_routes(root / "routes.json", {
        "targets": [{"name": "e1", "address": address},
                    {"name": "t1", "address": address, "requests_per_minute": 1},
                    {"name": "t2", "address": address, "requests_per_minute": 1}],
        "models": {MODEL: "e1", LIMITED: {"route": {"strategy": "fallback", "targets": ["t1", "t2"]}}}})
    keys = root / "keys.json"
    keys.write_text(json.dumps([
        *({"key": key, "tenant": f"{name}-tenant", "requests_per_minute": 1} for name, key in ONE_A_MINUTE.items()),
        {"key": TOKENS_KEY, "tenant": "tokens-tenant", "tokens_per_minute": 300},
        {"key": OPEN_KEY, "tenant": "open-tenant"}]))
    keys.chmod(0o600)
    gateway = await start_gateway(root, "routes.json", ["--api-keys-file", "keys.json"])
    try:
        yield Stack(root, engine, gateway)
    finally:
        gateway.stop()
        await stop_all(engine)


def assert_retry_after(headers, at_least: float, at_most: float) -> None:
    value = headers["retry-after"]
    assert value.isdigit() and at_least <= int(value) <= at_most, value


CALLS = {
    "chat": lambda c, **kw: c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, **kw),
    "completions": lambda c, **kw: c.completions.with_raw_response.create(model=MODEL, prompt="Once", max_tokens=4,
                                                                          **kw),
    "responses": lambda c, **kw: c.responses.with_raw_response.create(model=MODEL, input="Hi", max_output_tokens=4,
                                                                      **kw),
}


@pytest.mark.parametrize("endpoint", list(CALLS))
async def test_a_key_over_its_requests_per_minute_is_429_in_openais_envelope(stack, endpoint):
    client = stack.openai(ONE_A_MINUTE[endpoint])
    first = await CALLS[endpoint](client)
    assert first.http_response.status_code == 200
    with pytest.raises(openai.RateLimitError) as refused:
        await CALLS[endpoint](client, stream=True)
    assert refused.value.status_code == 429
    assert_retry_after(refused.value.response.headers, 55, 60)  # one request a minute, just spent
    error = refused.value.body
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded", error
    assert "requests_per_minute 1" in error["message"], error
    other = await CALLS[endpoint](stack.openai(OPEN_KEY))  # another key is not held back
    assert other.http_response.status_code == 200


async def test_a_key_over_its_requests_per_minute_is_429_in_anthropics_envelope(stack):
    client = anthropic.AsyncAnthropic(base_url=stack.gateway.base, api_key=ONE_A_MINUTE["messages"], max_retries=0,
                                      timeout=60)
    request = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    answer = await client.messages.create(**request)
    assert answer.usage.output_tokens >= 1
    for stream in (False, True):
        with pytest.raises(anthropic.RateLimitError) as refused:
            await client.messages.create(**request, stream=stream)
        assert refused.value.status_code == 429
        assert_retry_after(refused.value.response.headers, 55, 60)
        body = refused.value.body
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
        assert "requests_per_minute 1" in body["error"]["message"]


async def test_count_tokens_is_held_to_the_keys_requests_per_minute(stack):
    client = anthropic.AsyncAnthropic(base_url=stack.gateway.base, api_key=ONE_A_MINUTE["count"], max_retries=0,
                                      timeout=60)
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    assert (await client.messages.count_tokens(**request)).input_tokens > 0
    with pytest.raises(anthropic.RateLimitError) as refused:
        await client.messages.count_tokens(**request)
    assert refused.value.status_code == 429
    assert_retry_after(refused.value.response.headers, 55, 60)
    body = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
    assert "requests_per_minute 1" in body["error"]["message"]


async def test_a_key_over_its_requests_per_minute_is_resource_exhausted_over_grpc(stack):
    async with create_channel(f"127.0.0.1:{stack.gateway.grpc_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(text="Once")
        request.stop.max_tokens = 4
        metadata = ((MODEL_HEADER, MODEL), ("authorization", f"Bearer {ONE_A_MINUTE['grpc']}"))
        replies = [r async for r in stub.Generate(request, timeout=30, metadata=metadata)]
        assert replies[-1].HasField("finished")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(request, timeout=30, metadata=metadata):
                pass
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "requests_per_minute 1" in refused.value.details()
        pushback = dict(refused.value.trailing_metadata())["grpc-retry-pushback-ms"]
        assert 55_000 <= int(pushback) <= 60_000, pushback


async def test_tokens_per_minute_count_the_prompt_and_metrics_count_each_keys_usage(stack):
    client = stack.openai(TOKENS_KEY)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=MODEL, prompt="Once", max_tokens=301)
    assert refused.value.body["param"] == "max_tokens"
    assert "tokens_per_minute 300" in refused.value.body["message"]
    answer = await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=100,
                                             extra_body={"ignore_eos": True})
    usage = answer.usage
    assert usage.completion_tokens == 100 and usage.prompt_tokens > 150  # the premise: a long prompt
    # 300 - 100 reserved leaves 200 (refilling 5 a second): another 100 fits unless the prompt
    # was charged when the first request settled.
    with pytest.raises(openai.RateLimitError) as refused:
        await client.completions.create(model=MODEL, prompt="Once", max_tokens=100)
    assert "tokens_per_minute 300" in refused.value.body["message"]
    assert_retry_after(refused.value.response.headers, 1, 60)
    text = await stack.metrics()
    assert f'tokenmill:gateway_key_tokens_total{{kind="prompt",tenant="tokens-tenant"}} {usage.prompt_tokens}.0' \
        in text, text
    assert 'tokenmill:gateway_key_tokens_total{kind="completion",tenant="tokens-tenant"} 100.0' in text
    assert 'tokenmill:gateway_key_requests_total{outcome="tokens_per_minute",tenant="tokens-tenant"} 1.0' in text
    assert 'tokenmill:gateway_key_requests_total{outcome="admitted",tenant="tokens-tenant"} 1.0' in text
    assert not any(key in text for key in (TOKENS_KEY, OPEN_KEY, *ONE_A_MINUTE.values()))


async def test_a_target_at_its_limit_is_passed_over_then_the_route_is_429(stack):
    client = stack.openai(OPEN_KEY)
    served = []
    for _ in range(2):
        raw = await client.completions.with_raw_response.create(model=LIMITED, prompt="Once", max_tokens=2)
        served.append(raw.headers["x-tokenmill-target"])
    assert served == ["t1", "t2"]
    with pytest.raises(openai.RateLimitError) as refused:
        await client.completions.create(model=LIMITED, prompt="Once", max_tokens=2)
    assert f"every target of model '{LIMITED}' is at its rate limit" in refused.value.body["message"]
    assert_retry_after(refused.value.response.headers, 50, 60)
    text = await stack.metrics()
    assert 'tokenmill:gateway_target_rate_limited_total{limit="requests_per_minute",target="t1"} 2.0' in text
