"""The gateway's OpenAI-compatible API through the official ``openai`` client, against a real
stories260K engine (tokenizer, executor and scheduler servers on loopback, with tenants).

Each pitfall users hit in OpenAI-compatible servers is a test here: the usage chunk of
``stream_options``, ``n``, list and token-id prompts, bad parameters as 400 naming the field,
an unknown model as 404, OpenAI's error envelope everywhere, ``max_completion_tokens``, one
``finish_reason`` per choice while other requests come and go, greedy output independent of
the prefix cache; and the same text as the engine's own gRPC API.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest
import pytest_asyncio
import structlog
import structlog.testing

from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import RunningServer, create_channel
from tests.helpers.gateway_stack import (
    serve_engine,
    serve_gateway_for,
    stop_all,
    stories_with_chat_template,
    wait_healthy,
    write_routes,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

ALPHA = "token-of-alpha-0123456789"
ELSEWHERE = "token-of-elsewhere-0123456789"
THRIFTY = "token-of-thrifty-0123456789"
TENANTS = [{"token": ALPHA, "tenant": "alpha"},
           {"token": ELSEWHERE, "tenant": "elsewhere", "models": ["another-model"]},
           {"token": THRIFTY, "tenant": "thrifty", "tokens_per_minute": 12}]
PROMPT = "Once upon a time"
LONG_PROMPT = ("Once upon a time there was a little girl named Lily. She liked to play in the park with her "
               "friends. One day she saw a big red ball under a tree.")


@dataclass
class Gateway:
    servers: list[RunningServer]
    gateway: RunningServer
    scheduler: RunningServer
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient
    engine: generation_pb2_grpc.GenerationStub
    routed: generation_pb2_grpc.GenerationStub

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(tmp_path_factory, monkeypatch_module) -> AsyncIterator[Gateway]:
    root = tmp_path_factory.mktemp("gateway")
    (root / "tenants.json").write_text(json.dumps(TENANTS))
    (root / "tenants.json").chmod(0o600)  # the scheduler refuses a tokens file others may read
    model = stories_with_chat_template(root)
    engine = await serve_engine(model=model, auth_tokens_file=str(root / "tenants.json"))
    scheduler = engine[-1]
    monkeypatch_module.setenv("TEST_GATEWAY_TOKEN", ALPHA)
    routes = write_routes(root / "routes.json", {
        "targets": [{"name": "e1", "address": scheduler.address, "token_env": "TEST_GATEWAY_TOKEN"},
                    {"name": "dead", "address": "127.0.0.1:9"}],
        "models": {"stories": {"route": {"strategy": "latency", "targets": ["e1"]}, "tokenizer": str(model)},
                   "plain": "e1",
                   "down": "dead"}})
    gateway = await serve_gateway_for(routes, max_request_bytes=64 * 1024)
    await wait_healthy(gateway, ["e1"])
    base = f"http://127.0.0.1:{gateway.http_port}"
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=ALPHA, max_retries=0, timeout=60)
    async with create_channel(scheduler.address) as c1, create_channel(gateway.address) as c2, \
            httpx.AsyncClient(base_url=base, timeout=60) as http:
        yield Gateway([gateway, *reversed(engine)], gateway, scheduler, client, http,
                      generation_pb2_grpc.GenerationStub(c1), generation_pb2_grpc.GenerationStub(c2))
    await client.close()
    await stop_all([gateway, *reversed(engine)])


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


AUTH = (("authorization", f"Bearer {ALPHA}"),)


async def grpc_greedy(stub, max_tokens: int, text: str | None = None, ids: list[int] | None = None,
                      chat: list[dict] | None = None, metadata=AUTH) -> tuple[str, list[int]]:
    request = generation_pb2.GenerateRequest()
    if text is not None:
        request.text = text
    elif ids is not None:
        request.token_ids.ids.extend(ids)
    else:
        for m in chat:
            request.chat.messages.add(role=m["role"], content=m["content"])
    request.sampling.temperature = 0.0
    request.stop.max_tokens = max_tokens
    text_out, ids_out = [], []
    async for reply in stub.Generate(request, metadata=metadata, timeout=60):
        if reply.WhichOneof("event") == "delta":
            text_out.append(reply.delta.text)
            ids_out.extend(reply.delta.token_ids)
    return "".join(text_out), ids_out


# ---------------------------------------------------------------------------- models
async def test_models_list_and_retrieve(gw):
    models = await gw.client.models.list()
    assert sorted(m.id for m in models.data) == ["down", "plain", "stories"]
    assert (await gw.client.models.retrieve("stories")).id == "stories"
    with pytest.raises(openai.NotFoundError):
        await gw.client.models.retrieve("gpt-17")


# ---------------------------------------------------------------------------- greedy parity
async def test_greedy_completion_equals_the_grpc_api(gw):
    expected, ids = await grpc_greedy(gw.engine, 24, text=PROMPT)
    got = await gw.client.completions.create(model="stories", prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.choices[0].text == expected
    assert got.usage.completion_tokens == len(ids)
    assert got.choices[0].finish_reason in ("length", "stop")
    routed, _ = await grpc_greedy(gw.routed, 24, text=PROMPT)  # the gateway's own gRPC API
    assert routed == expected


async def test_greedy_chat_equals_the_grpc_api(gw):
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A cat"}]
    expected, _ = await grpc_greedy(gw.engine, 20, chat=messages)
    got = await gw.client.chat.completions.create(model="stories", messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.content == expected
    assert got.choices[0].message.role == "assistant"
    assert got.object == "chat.completion"


async def test_token_id_and_list_prompts(gw):
    ids = [1, 403, 407, 261, 378]
    expected, _ = await grpc_greedy(gw.engine, 12, ids=ids)
    one = await gw.client.completions.create(model="stories", prompt=ids, max_tokens=12, temperature=0)
    assert one.choices[0].text == expected
    many = await gw.client.completions.create(model="stories", prompt=[ids, ids[:3]], max_tokens=12, temperature=0)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == expected
    texts = await gw.client.completions.create(model="stories", prompt=[PROMPT, "The cat"], max_tokens=8,
                                               temperature=0, n=2)
    assert [c.index for c in texts.choices] == [0, 1, 2, 3]
    assert texts.choices[0].text == texts.choices[1].text  # greedy: both choices of a prompt agree
    assert texts.choices[0].text != texts.choices[2].text


async def test_greedy_output_does_not_depend_on_the_prefix_cache(gw):
    first = await gw.client.completions.create(model="stories", prompt=LONG_PROMPT, max_tokens=16, temperature=0)
    again = await gw.client.completions.create(model="stories", prompt=LONG_PROMPT, max_tokens=16, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the second one hit the prefix cache
    assert again.choices[0].text == first.choices[0].text


async def test_echo_prepends_the_prompt_also_for_token_ids(gw):
    got = await gw.client.completions.create(model="stories", prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert got.choices[0].text.startswith(PROMPT) and len(got.choices[0].text) > len(PROMPT)
    ids = await gw.client.completions.create(model="stories", prompt=[1, 403, 407], max_tokens=3, temperature=0,
                                             echo=True)
    assert ids.choices[0].text.startswith("Once upon")
    with pytest.raises(openai.BadRequestError) as info:  # no tokenizer on this route: it cannot show ids
        await gw.client.completions.create(model="plain", prompt=[1, 403], max_tokens=3, echo=True)
    assert info.value.response.json()["error"]["param"] == "echo"


async def test_streamed_echo_opens_with_the_prompt(gw):
    args = dict(model="stories", prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    whole = await gw.client.completions.create(**args)
    chunks = await collect(await gw.client.completions.create(**args, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_stream_options_without_stream_is_400_naming_it(gw, endpoint):
    args = dict(model="stories", max_tokens=4, stream_options={"include_usage": True})
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            await gw.client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **args)
        else:
            await gw.client.completions.create(prompt=PROMPT, **args)
    error = envelope(info.value)
    assert error["param"] == "stream_options" and "stream" in error["message"], error


async def test_echo_with_logprobs_shows_the_prompts_tokens_first_streamed_and_not(gw):
    args = dict(model="stories", prompt=LONG_PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=2)
    whole = await gw.client.completions.create(**args)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(value <= 0.0 for value in lp.token_logprobs[1:])
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # The output's part is what logprobs without echo gives (that one reads the prefix cache:
    # its prompt computed in other steps, the last digits may differ).
    plain = await gw.client.completions.create(**{**args, "echo": False})
    assert lp.tokens[whole.usage.prompt_tokens:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[whole.usage.prompt_tokens:] == pytest.approx(plain.choices[0].logprobs.token_logprobs,
                                                                          abs=1e-4)
    # The prompt's part: vLLM's prompt_logprobs of the same request, the prompt token's entry.
    vllm = (await gw.http.post("/v1/completions", json={**args, "echo": False, "prompt_logprobs": 1},
                               headers={"Authorization": f"Bearer {ALPHA}"})).json()["choices"][0]
    positions = vllm["prompt_logprobs"]
    assert len(positions) == whole.usage.prompt_tokens and positions[0] is None
    chosen = [next(e["logprob"] for e in p.values() if e["decoded_token"] == token)
              for p, token in zip(positions[1:], lp.tokens[1:])]
    assert chosen == lp.token_logprobs[1:whole.usage.prompt_tokens]
    chunks = await collect(await gw.client.completions.create(**args, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


async def test_prompt_logprobs_read_no_prefix_cache_and_come_on_chat_too(gw):
    args = dict(model="stories", prompt=LONG_PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0})
    first = (await gw.client.completions.create(**args)).model_dump()
    again = (await gw.client.completions.create(**args)).model_dump()  # its prefix is cached by now
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["prompt_logprobs"] == first["choices"][0]["prompt_logprobs"]
    assert all(len(p) == 1 for p in first["choices"][0]["prompt_logprobs"][1:])  # 0 alternatives: the token alone
    chat = (await gw.client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=2, extra_body={"prompt_logprobs": 1})).model_dump()
    positions = chat["prompt_logprobs"]
    assert len(positions) == chat["usage"]["prompt_tokens"] and positions[0] is None
    assert all(any(e["rank"] == 1 for e in p.values()) for p in positions[1:])


# ---------------------------------------------------------------------------- streaming
async def collect(stream) -> list:
    return [chunk async for chunk in stream]


def finish_reasons(chunks) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                out.setdefault(choice.index, []).append(choice.finish_reason)
    return out


async def test_streamed_completion_has_one_finish_reason_and_no_usage_chunk_unless_asked(gw):
    expected, _ = await grpc_greedy(gw.engine, 24, text=PROMPT)
    chunks = await collect(await gw.client.completions.create(model="stories", prompt=PROMPT, max_tokens=24,
                                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert finish_reasons(chunks) == {0: [chunks[-1].choices[0].finish_reason]}
    assert all(c.choices and c.usage is None for c in chunks)


async def test_include_usage_sends_one_last_chunk_with_empty_choices(gw):
    plain = await gw.client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=10, temperature=0)
    chunks = await collect(await gw.client.chat.completions.create(
        model="stories", messages=[{"role": "user", "content": "Hi"}], max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.total_tokens == plain.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == plain.choices[0].message.content
    assert finish_reasons(chunks) == {0: [plain.choices[0].finish_reason]}


async def test_raw_sse_frames_end_with_done(gw):
    body = {"model": "stories", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    async with gw.http.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {ALPHA}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in r.aiter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1


async def test_n_choices_streamed_each_finish_once_while_other_requests_come_and_go(gw):
    async def other(i):
        return await gw.client.completions.create(model="stories", prompt=f"The dog {i}", max_tokens=6 + i)

    stream = await gw.client.completions.create(model="stories", prompt=PROMPT, max_tokens=40, n=3, stream=True,
                                                extra_body={"ignore_eos": True})
    chunks, _ = await asyncio.gather(collect(stream), asyncio.gather(*(other(i) for i in range(6))))
    assert finish_reasons(chunks) == {0: ["length"], 1: ["length"], 2: ["length"]}
    for index in range(3):
        text = "".join(ch.text for c in chunks for ch in c.choices if ch.index == index)
        assert text


# ---------------------------------------------------------------------------- sampling parameters
async def test_seeded_sampling_is_reproducible_and_n_uses_derived_seeds(gw):
    args = dict(model="stories", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234)
    a = await gw.client.completions.create(n=2, **args)
    b = await gw.client.completions.create(n=2, **args)
    single = await gw.client.completions.create(n=1, **args)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert single.choices[0].text == a.choices[0].text
    assert a.choices[0].text != a.choices[1].text
    negative = await gw.client.completions.create(**{**args, "seed": -5})
    assert negative.choices[0].text == (await gw.client.completions.create(**{**args, "seed": -5})).choices[0].text


async def test_stop_strings_end_with_stop_and_are_trimmed(gw):
    expected, _ = await grpc_greedy(gw.engine, 24, text=PROMPT)
    word = expected.split()[3]
    got = await gw.client.completions.create(model="stories", prompt=PROMPT, max_tokens=24, temperature=0, stop=[word])
    assert got.choices[0].finish_reason == "stop"
    assert word not in got.choices[0].text and expected.startswith(got.choices[0].text)


async def test_max_completion_tokens_is_honoured(gw):
    got = await gw.client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Hi"}],
                                                  max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 5 and got.choices[0].finish_reason == "length"


async def test_completion_logprobs_name_each_token(gw):
    got = await gw.client.completions.create(model="stories", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == got.usage.completion_tokens
    assert "".join(lp.tokens) == got.choices[0].text
    assert all(len(top) <= 3 and max(top.values()) <= 0.0 for top in lp.top_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(abs(max(top.values()) - value) < 1e-4 for top, value in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


async def test_chat_logprobs_and_top_logprobs(gw):
    got = await gw.client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "A dog"}],
                                                  max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.bytes is not None for entry in content)
    assert "".join(entry.token for entry in content) == got.choices[0].message.content


async def test_vllm_extras_are_passed_to_the_engine(gw):
    got = await gw.client.completions.create(model="stories", prompt=PROMPT, max_tokens=12, temperature=0.8, seed=7,
                                             extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2,
                                                         "min_tokens": 12, "ignore_eos": True})
    assert got.usage.completion_tokens == 12


# ---------------------------------------------------------------------------- errors
def envelope(error: openai.APIStatusError) -> dict:
    body = error.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(temperature=-1), "temperature", "greater than or equal to 0"),
    (dict(top_p=0), "top_p", "greater than 0"),
    (dict(n=0), "n", "greater than or equal to 1"),
    (dict(presence_penalty=3), "presence_penalty", "less than or equal to 2"),
    (dict(logprobs=50), "logprobs", "less than or equal to 20"),
    (dict(max_tokens=100000), "max_tokens", "context limit"),
    (dict(suffix="x"), "suffix", "not supported"),
    (dict(best_of=3), "best_of", "not supported"),
    (dict(stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs", "stream"),
    (dict(logit_bias={"nope": 1}), "logit_bias", "token ids"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    (dict(stop=[""]), "stop.0", "at least 1 character"),
    (dict(n=10, prompt=[PROMPT] * 7), "n", "the limit is 64"),
])
async def test_bad_parameters_are_400_naming_the_field(gw, kwargs, param, words):
    args = dict(model="stories", prompt=PROMPT, max_tokens=4)
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as info:
        await gw.client.completions.create(**args)
    error = envelope(info.value)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("field", ["functions", "function_call", "audio"])
async def test_unsupported_chat_fields_are_400_naming_them(gw, field):
    value = {"functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "alloy"}}[field]
    with pytest.raises(openai.BadRequestError) as info:
        await gw.client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "x"}],
                                                extra_body={field: value})
    assert envelope(info.value)["param"] == field


async def test_unknown_model_is_404_model_not_found(gw):
    with pytest.raises(openai.NotFoundError) as info:
        await gw.client.completions.create(model="gpt-17", prompt=PROMPT)
    assert envelope(info.value)["code"] == "model_not_found"


async def test_unknown_and_forbidden_tenants_are_401_and_403(gw):
    stranger = gw.client.with_options(api_key="no-such-token")
    with pytest.raises(openai.AuthenticationError) as info:
        await stranger.completions.create(model="stories", prompt=PROMPT, max_tokens=2)
    assert envelope(info.value)["type"] == "authentication_error"
    with pytest.raises(openai.PermissionDeniedError):
        await gw.client.with_options(api_key=ELSEWHERE).completions.create(model="stories", prompt=PROMPT,
                                                                           max_tokens=2)


async def test_a_spent_budget_is_429_with_retry_after(gw):
    thrifty = gw.client.with_options(api_key=THRIFTY)
    await thrifty.completions.create(model="stories", prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    with pytest.raises(openai.RateLimitError) as info:
        await thrifty.completions.create(model="stories", prompt=PROMPT, max_tokens=4)
    assert int(info.value.response.headers["retry-after"]) >= 1
    assert envelope(info.value)["code"] == "rate_limit_exceeded"


async def test_no_healthy_target_is_503(gw):
    with pytest.raises(openai.InternalServerError) as info:
        await gw.client.completions.create(model="down", prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 503 and "no healthy target" in envelope(info.value)["message"]


async def test_a_body_over_the_limit_is_413(gw):
    with pytest.raises(openai.APIStatusError) as info:
        await gw.client.completions.create(model="stories", prompt="x" * 100_000, max_tokens=2)
    assert info.value.status_code == 413 and envelope(info.value)["code"] == "request_too_large"


async def test_lists_are_counted_before_their_items_are_validated(gw):
    # 1,025 turns: refused by the gateway itself (an 8 MiB body of empty turns used to cost the
    # gateway's event loop seconds of validation), and a stream beside it is served.
    many = await gw.http.post("/v1/chat/completions", headers={"authorization": f"Bearer {ALPHA}"}, json={
        "model": "stories", "messages": [{"role": "user", "content": ""}] * 1025})
    assert many.status_code == 400, many.text
    error = many.json()["error"]
    assert error["param"] == "messages" and "at most 1024 entries, got 1025" in error["message"], error
    bias = await gw.http.post("/v1/completions", headers={"authorization": f"Bearer {ALPHA}"}, json={
        "model": "stories", "prompt": PROMPT, "logit_bias": {str(i): 1 for i in range(1025)}})
    assert bias.status_code == 400 and bias.json()["error"]["param"] == "logit_bias", bias.text
    done = await gw.client.completions.create(model="stories", prompt=PROMPT, max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 4


async def test_framework_errors_use_the_openai_envelope(gw):
    bad_json = await gw.http.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    missing = await gw.http.post("/v1/chat/completions", json={"model": "stories"})
    no_route = await gw.http.get("/v2/nothing")
    wrong_method = await gw.http.get("/v1/completions")
    for response, status in ((bad_json, 400), (missing, 400), (no_route, 404), (wrong_method, 405)):
        assert response.status_code == status
        assert set(response.json()) == {"error"}, response.json()
    assert missing.json()["error"]["param"] == "messages"


async def test_request_id_goes_in_and_out(gw):
    response = await gw.http.post("/v1/completions", json={"model": "stories", "prompt": PROMPT, "max_tokens": 2},
                                  headers={"X-Request-Id": "my-request-42", "Authorization": f"Bearer {ALPHA}"})
    assert response.headers["x-request-id"] == "my-request-42" and response.json()["id"] == "cmpl-my-request-42"
    fresh = await gw.http.get("/v1/models")
    assert len(fresh.headers["x-request-id"]) == 32


async def test_the_serving_target_is_named_in_a_header_and_the_log_line(gw):
    auth = {"Authorization": f"Bearer {ALPHA}"}
    with structlog.testing.capture_logs() as logs:
        plain = await gw.http.post("/v1/completions", json={"model": "stories", "prompt": PROMPT, "max_tokens": 2},
                                   headers={**auth, "X-Request-Id": "named-target-1"})
    assert plain.status_code == 200 and plain.headers["x-tokenmill-target"] == "e1"
    routed = [e for e in logs if e["event"] == "request_routed" and e["request_id"].startswith("named-target-1")]
    assert routed and all((e["target"], e["model"], e["outcome"]) == ("e1", "stories", "ok") for e in routed), logs
    body = {"model": "stories", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "stream": True}
    async with gw.http.stream("POST", "/v1/chat/completions", json=body, headers=auth) as streamed:
        assert streamed.status_code == 200 and streamed.headers["x-tokenmill-target"] == "e1"
        _ = [line async for line in streamed.aiter_lines()]


# ---------------------------------------------------------------------------- disconnects, health, metrics
async def engine_profile(gw):
    return await gw.engine.GetProfile(generation_pb2.GetProfileRequest(), metadata=AUTH, timeout=10)


async def test_a_client_that_disconnects_mid_stream_frees_the_engines_kv(gw):
    body = {"model": "stories", "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    async with gw.http.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {ALPHA}"}) as r:
        lines = r.aiter_lines()
        for _ in range(3):
            await anext(lines)
        assert (await engine_profile(gw)).num_running == 1
    for _ in range(100):  # closed: the engine aborts the request at its next step
        profile = await engine_profile(gw)
        if profile.num_running == 0 and profile.kv_cache_usage == 0.0:
            break
        await asyncio.sleep(0.05)
    assert (profile.num_running, profile.kv_cache_usage) == (0, 0.0)


async def test_health_and_metrics(gw):
    health = await gw.http.get("/health")
    assert health.status_code == 503 and health.json()["models_without_targets"] == ["down"]
    ready = await gw.http.get("/ready", params={"model": "stories"})
    assert ready.status_code == 200 and ready.json()["healthy_targets"] == {"stories": ["e1"]}
    assert (await gw.http.get("/ready", params={"model": "down"})).status_code == 503
    assert (await gw.http.get("/ready")).status_code == 503  # every model: "down" has no healthy target
    assert (await gw.http.get("/ready", params={"model": "nope"})).status_code == 404
    text = (await gw.http.get("/metrics")).text
    assert 'tokenmill:gateway_decisions_total{model="stories",reason=' in text
    assert "tokenmill:gateway_routing_seconds_bucket" in text
    assert 'tokenmill:gateway_target_healthy{target="dead"} 0.0' in text
    assert "tokenmill:gateway_estimate_ratio_bucket" in text


# ---------------------------------------------------------------------------- the gateway's gRPC API
async def test_grpc_front_end_routes_by_metadata(gw):
    request = generation_pb2.GenerateRequest(text=PROMPT)
    request.stop.max_tokens = 3
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(_drain(gw.routed.Generate(request, metadata=AUTH + (("x-tokenmill-model", "x"),))), 30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    info_reply = await gw.routed.GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                              metadata=(("x-tokenmill-model", "plain"),), timeout=10)
    assert info_reply.model_name == "plain" and info_reply.max_model_len > 0
    profile = await gw.routed.GetProfile(generation_pb2.GetProfileRequest(), timeout=10)
    assert profile.num_requests > 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _drain(gw.routed.Generate(request, metadata=AUTH + (("x-tokenmill-sla-ms", "fast"),)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-tokenmill-sla-ms" in info.value.details()


async def test_grpc_abort_reaches_the_serving_engine(gw):
    request = generation_pb2.GenerateRequest(text=PROMPT, request_id="abort-me")
    request.stop.max_tokens = 400
    request.stop.ignore_eos = True
    call = gw.routed.Generate(request, metadata=AUTH, timeout=60)
    first = await call.read()
    assert first.WhichOneof("event") == "started"
    reply = await gw.routed.Abort(generation_pb2.AbortRequest(request_id="abort-me"), metadata=AUTH, timeout=10)
    assert reply.found
    rest = []
    while (message := await call.read()) is not grpc.aio.EOF:
        rest.append(message)
    assert rest[-1].finished.finish_reason == 4  # FINISH_REASON_ABORT


async def _drain(call):
    return [m async for m in call]


async def test_a_request_over_the_timeout_is_504(gw, tmp_path):
    routes = write_routes(tmp_path / "routes.json", {
        "targets": [{"name": "e1", "address": gw.scheduler.address, "token_env": "TEST_GATEWAY_TOKEN"}],
        "models": {"stories": "e1"}})
    hasty = await serve_gateway_for(routes, request_timeout_s=0.2)
    await wait_healthy(hasty, ["e1"])
    try:
        client = gw.client.with_options(base_url=f"http://127.0.0.1:{hasty.http_port}/v1")
        with pytest.raises(openai.InternalServerError) as info:
            await client.completions.create(model="stories", prompt=PROMPT, max_tokens=500,
                                            extra_body={"ignore_eos": True})
        assert info.value.status_code == 504 and envelope(info.value)["type"] == "timeout"
    finally:
        await hasty.stop(grace=0)


async def test_streamed_logprobs_cover_every_token(gw):
    chunks = await collect(await gw.client.completions.create(model="stories", prompt=PROMPT, max_tokens=10,
                                                              temperature=0, logprobs=2, stream=True))
    tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    text = "".join(ch.text for c in chunks for ch in c.choices)
    assert len(tokens) == 10 and "".join(tokens) == text
    chat = await collect(await gw.client.chat.completions.create(
        model="stories", messages=[{"role": "user", "content": "A dog"}], max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=1, stream=True))
    entries = [e for c in chat for ch in c.choices if ch.logprobs and ch.logprobs.content for e in ch.logprobs.content]
    assert len(entries) == 6 and all(len(e.top_logprobs) == 1 for e in entries)
