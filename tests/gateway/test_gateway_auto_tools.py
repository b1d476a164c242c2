"""tool_choice auto end to end, with the official ``openai`` client: SmolLM2-135M-Instruct behind a
chat template with the Hermes ``<tool_call>`` convention (tokenizer, executor and scheduler
servers on loopback, the gateway in front). The tools reach the template (the prompt grows by
them), the engine reports the template's format, and greedy decoding after two worked examples
writes a ``<tool_call>`` block that the gateway parses into tool_calls with finish_reason
tool_calls, streamed (the name once, the arguments in pieces) and not. The same request on a
route whose tool_call_parser is none shows the text the model really wrote.

A history with an assistant's tool_calls and the tool's results reaches the template as
structure: the prompt is the one transformers' apply_chat_template makes of it (its length, and
the greedy reply the same ids get as a completions prompt), and the gateway sends each turn's
calls, tool_call_id and name; a tool turn without tool_call_id, or arguments that are not JSON,
are a 400 naming the field. With ``parallel_tool_calls`` false a reply that would make two calls
makes one: the choice ends at its first call, streamed and not, and the engine stops there (with
ignore_eos it generated the reply's tokens, not max_tokens).

The engine has tenants. The gateway polls target e1 with a tenant's token (``token_env``); the
same engine behind target e1-tokenless, with no token in the routes file, refuses the gateway's
polls: ``auto`` there learns the format with the caller's token and still reads the call."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import pytest_asyncio
import transformers

from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import RunningServer, create_channel
from services.gateway.http.engine_request import chat_template
from services.gateway.http.protocol import ChatCompletionRequest
from services.gateway.tool_calls.hermes import HermesParser
from services.gateway.tool_calls.reader import read_whole
from tests.helpers.gateway_stack import serve_engine, serve_gateway_for, stop_all, wait_healthy, write_routes
from tests.helpers.tool_templates import SMOLLM2_DIR, smollm2_with_hermes_template

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def worked_call(city: str) -> str:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % city


# Two worked examples, then the question: greedy decoding follows the pattern.
MESSAGES = [{"role": "user", "content": "What is the weather in Rome?"},
            {"role": "assistant", "content": worked_call("Rome")},
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"role": "assistant", "content": worked_call("Oslo")},
            {"role": "user", "content": "What is the weather in Paris?"}]
TENANT_TOKEN, TOKEN_ENV = "token-of-tenant-a-0123456789", "AUTO_TOOLS_TEST_ENGINE_TOKEN"
AS_TENANT = (("authorization", f"Bearer {TENANT_TOKEN}"),)
REQUEST = dict(messages=MESSAGES, tools=[WEATHER], temperature=0, max_tokens=48)


@dataclass
class Stack:
    servers: list[RunningServer]
    client: openai.AsyncOpenAI
    engine: generation_pb2_grpc.GenerationStub
    model: Path


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[Stack]:
    assert (SMOLLM2_DIR / "config.json").is_file(), f"{SMOLLM2_DIR} is absent: `make install` converts it"
    root = tmp_path_factory.mktemp("auto-tools")
    model = smollm2_with_hermes_template(root)
    tenants = root / "tenants.json"
    tenants.write_text(json.dumps([{"token": TENANT_TOKEN, "tenant": "a"}]))
    tenants.chmod(0o600)
    engine = await serve_engine(model=model, num_blocks=96, max_model_len=1024, auth_tokens_file=str(tenants))
    os.environ[TOKEN_ENV] = TENANT_TOKEN
    routes = write_routes(root / "routes.json", {
        "targets": [{"name": "e1", "address": engine[-1].address, "token_env": TOKEN_ENV},
                    {"name": "e1-tokenless", "address": engine[-1].address}],
        "models": {"smol": "e1", "smol-text": {"route": "e1", "tool_call_parser": "none"},
                   "smol-tokenless": "e1-tokenless"}})
    gateway = await serve_gateway_for(routes)  # --tool-call-parser auto: the engine's format
    del os.environ[TOKEN_ENV]
    await wait_healthy(gateway, ["e1", "e1-tokenless"])
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key=TENANT_TOKEN,
                                max_retries=0, timeout=300)
    async with create_channel(engine[-1].address) as channel:
        yield Stack([gateway, *reversed(engine)], client, generation_pb2_grpc.GenerationStub(channel), model)
    await client.close()
    await stop_all([gateway, *reversed(engine)])


async def test_the_engine_reports_its_template_format_and_renders_the_tools(stack):
    info = await stack.engine.GetModelInfo(generation_pb2.GetModelInfoRequest(), metadata=AS_TENANT)
    assert info.tool_call_format == "hermes"
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    plain = await stack.client.chat.completions.create(model="smol", messages=question, max_tokens=1)
    tooled = await stack.client.chat.completions.create(model="smol", messages=question, tools=[WEATHER],
                                                        tool_choice="none", max_tokens=1)
    # The template's tool preamble (the schema, the call format) is in the prompt only with tools.
    assert tooled.usage.prompt_tokens > plain.usage.prompt_tokens + 60


async def test_auto_parses_the_call_the_model_wrote(stack):
    raw = await stack.client.chat.completions.create(model="smol-text", **REQUEST)
    written = raw.choices[0].message.content
    assert raw.choices[0].finish_reason == "stop" and "<tool_call>" in written and not raw.choices[0].message.tool_calls
    expected = read_whole(HermesParser(frozenset({"get_weather"})), written)
    assert len(expected.calls) == 1

    reply = await stack.client.chat.completions.create(model="smol", tool_choice="auto", **REQUEST)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == expected.content
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert (call.function.name, call.function.arguments) == expected.calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert reply.usage.completion_tokens == raw.usage.completion_tokens


async def test_auto_reads_calls_of_an_engine_that_refuses_the_gateways_own_polls(stack):
    tokenless = stack.servers[0].dispatcher.pool.targets["e1-tokenless"]
    assert tokenless.refused == "UNAUTHENTICATED" and tokenless.model_info is None
    expected = await stack.client.chat.completions.create(model="smol", **REQUEST)
    for stream in (True, False):
        reply = await stack.client.chat.completions.create(model="smol-tokenless", stream=stream, **REQUEST)
        if stream:
            finish, names = None, []
            async for chunk in reply:
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                    names += [d.function.name for d in choice.delta.tool_calls or () if d.function.name]
            assert (finish, names) == ("tool_calls", ["get_weather"])
        else:
            assert reply.choices[0].finish_reason == "tool_calls"
            assert [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls] == \
                [(c.function.name, c.function.arguments) for c in expected.choices[0].message.tool_calls]
    assert tokenless.model_info.tool_call_format == "hermes"


async def test_auto_streams_the_call_as_openai_deltas(stack):
    whole = await stack.client.chat.completions.create(model="smol", **REQUEST)
    stream = await stack.client.chat.completions.create(model="smol", stream=True, **REQUEST)
    names, ids, pieces, content, finish = [], set(), [], [], None
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
            for tool_delta in delta.tool_calls or ():
                assert tool_delta.index == 0
                if tool_delta.id is not None:
                    ids.add(tool_delta.id)
                    assert tool_delta.type == "function"
                if tool_delta.function.name is not None:
                    names.append(tool_delta.function.name)
                if tool_delta.function.arguments:
                    pieces.append(tool_delta.function.arguments)
            finish = choice.finish_reason or finish
    [call] = whole.choices[0].message.tool_calls
    assert names == ["get_weather"] and len(ids) == 1, "one call, named once"
    assert len(pieces) > 1, "the arguments come in pieces, as the model writes them"
    assert "".join(pieces) == call.function.arguments
    assert ("".join(content) or None) == whole.choices[0].message.content
    assert finish == "tool_calls"


# A history as the openai client sends it back: the call with its id, the result naming it.
HISTORY = [{"role": "user", "content": "What is the weather in Rome?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_rome", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
           {"role": "tool", "tool_call_id": "call_rome", "name": "get_weather", "content": "Sunny, 24 C"},
           {"role": "assistant", "content": "It is sunny in Rome, 24 C."},
           {"role": "user", "content": "What is the weather in Paris?"}]


async def test_a_tool_history_reaches_the_template_as_transformers_gives_it(stack):
    as_hf = [dict(m) for m in HISTORY]
    as_hf[1] = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_rome", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]}
    tokenizer = transformers.AutoTokenizer.from_pretrained(stack.model)
    ids = tokenizer.apply_chat_template(as_hf, tools=[WEATHER], add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    text = tokenizer.apply_chat_template(as_hf, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert "<tool_response>\nSunny, 24 C\n</tool_response>" in text
    # tool_choice none: the reply is the model's raw text, to compare with the same ids as a prompt.
    reply = await stack.client.chat.completions.create(model="smol", messages=HISTORY, tools=[WEATHER],
                                                       tool_choice="none", temperature=0, max_tokens=12)
    same = await stack.client.completions.create(model="smol", prompt=list(ids), temperature=0, max_tokens=12)
    assert reply.usage.prompt_tokens == same.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == same.choices[0].text
    # The prompts the history would make otherwise (the arguments left JSON text, which the
    # template writes as a quoted string; the calls flattened into the content, as the gateway
    # once sent them) have other lengths: the count above tells them apart.
    as_text = [*HISTORY[:1], {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": '
                                                              '"Rome"}}'}, *HISTORY[2:]]
    for other in (HISTORY, as_text):
        assert len(tokenizer.apply_chat_template(other, tools=[WEATHER], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]) != len(ids)


async def test_the_gateway_sends_every_tool_field_of_a_turn():
    body = ChatCompletionRequest(model="smol", messages=[
        *HISTORY[:1], {"role": "user", "name": "ana", "content": "Hi"}, *HISTORY[1:3]])
    turns = chat_template(body).chat.messages
    assert [(t.role, t.name, t.tool_call_id) for t in turns] == [
        ("user", "", ""), ("user", "ana", ""), ("assistant", "", ""), ("tool", "get_weather", "call_rome")]
    [call] = turns[2].tool_calls
    assert (call.id, call.name, call.arguments) == ("call_rome", "get_weather", '{"city": "Rome"}')
    assert not turns[2].HasField("content"), "content null beside calls stays null; the calls travel apart"
    assert turns[1].content == "Hi" and turns[3].content == "Sunny, 24 C"


@pytest.mark.parametrize(("turn", "param"), [
    ({"role": "tool", "content": "Sunny"}, "messages.2.tool_call_id"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": Rome}'}}]},
     "messages.2.tool_calls.0.function.arguments"),
])
async def test_a_bad_tool_turn_is_a_400_naming_the_field(stack, turn, param):
    messages = [HISTORY[0], HISTORY[3], turn, HISTORY[4]]
    with pytest.raises(openai.BadRequestError) as caught:
        await stack.client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER], max_tokens=1)
    error = caught.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(param)


def worked_calls(*cities: str) -> str:
    return "\n".join(worked_call(city) for city in cities)


# Worked examples of two calls a reply: greedy decoding writes two for the last question too.
TWO_CALLS = dict(messages=[{"role": "user", "content": "What is the weather in Rome and in Oslo?"},
                           {"role": "assistant", "content": worked_calls("Rome", "Oslo")},
                           {"role": "user", "content": "What is the weather in Lima and in Kyiv?"},
                           {"role": "assistant", "content": worked_calls("Lima", "Kyiv")},
                           {"role": "user", "content": "What is the weather in Paris and in Cairo?"}],
                 tools=[WEATHER], temperature=0, max_tokens=96)


async def test_parallel_tool_calls_false_makes_one_call_and_ends_the_generation(stack):
    both = await stack.client.chat.completions.create(model="smol", **TWO_CALLS)
    assert both.choices[0].finish_reason == "tool_calls"
    first, second = both.choices[0].message.tool_calls  # the model does write two
    reply = await stack.client.chat.completions.create(model="smol", parallel_tool_calls=False, **TWO_CALLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == (first.function.name, first.function.arguments)
    assert choice.message.content == both.choices[0].message.content
    # The engine stream ended at the first call: the second was never generated.
    assert 0 < reply.usage.completion_tokens < both.usage.completion_tokens
    assert reply.usage.completion_tokens < both.usage.completion_tokens - 10


async def test_parallel_tool_calls_false_streams_one_call(stack):
    whole = await stack.client.chat.completions.create(model="smol", parallel_tool_calls=False, **TWO_CALLS)
    stream = await stack.client.chat.completions.create(model="smol", parallel_tool_calls=False, stream=True,
                                                        stream_options={"include_usage": True}, **TWO_CALLS)
    indexes, names, pieces, finishes, usage = set(), [], [], [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            for tool_delta in choice.delta.tool_calls or ():
                indexes.add(tool_delta.index)
                if tool_delta.function.name is not None:
                    names.append(tool_delta.function.name)
                if tool_delta.function.arguments:
                    pieces.append(tool_delta.function.arguments)
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    [call] = whole.choices[0].message.tool_calls
    assert indexes == {0} and names == ["get_weather"]
    assert "".join(pieces) == call.function.arguments
    assert finishes == ["tool_calls"]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


async def test_parallel_tool_calls_false_ends_each_of_n_choices_at_its_call(stack):
    one = await stack.client.chat.completions.create(model="smol", parallel_tool_calls=False, **TWO_CALLS)
    [call] = one.choices[0].message.tool_calls
    both = await stack.client.chat.completions.create(model="smol", parallel_tool_calls=False, n=2, **TWO_CALLS)
    for choice in both.choices:
        [made] = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls"
        assert (made.function.name, made.function.arguments) == (call.function.name, call.function.arguments)
    assert both.usage.completion_tokens == 2 * one.usage.completion_tokens
    stream = await stack.client.chat.completions.create(model="smol", parallel_tool_calls=False, n=2, stream=True,
                                                        **TWO_CALLS)
    arguments: dict[int, list[str]] = {0: [], 1: []}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    async for chunk in stream:
        for choice in chunk.choices:
            for tool_delta in choice.delta.tool_calls or ():
                assert tool_delta.index == 0
                arguments[choice.index].append(tool_delta.function.arguments or "")
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    assert finishes == {0: ["tool_calls"], 1: ["tool_calls"]}
    assert {index: "".join(pieces) for index, pieces in arguments.items()} == {
        0: call.function.arguments, 1: call.function.arguments}


async def completion_tokens(reply) -> int:
    """A reply's usage.completion_tokens, read to its end when streamed."""
    if isinstance(reply, openai.types.chat.ChatCompletion):
        return reply.usage.completion_tokens
    usage = None
    async for chunk in reply:
        usage = chunk.usage or usage
    return usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
async def test_parallel_tool_calls_false_stops_the_engine_at_the_call(stack, stream):
    # With ignore_eos the engine would write all of max_tokens unless the gateway's cancel stops it.
    started = time.monotonic()
    extra = dict(stream=True, stream_options={"include_usage": True}) if stream else {}
    reply = await stack.client.chat.completions.create(
        model="smol", parallel_tool_calls=False, extra_body={"ignore_eos": True}, **{**TWO_CALLS, "max_tokens": 400},
        **extra)
    received = await completion_tokens(reply)
    for _ in range(200):  # the engine aborts the request at its next step and records it then
        profile = await stack.engine.GetProfile(generation_pb2.GetProfileRequest(
            window_seconds=time.monotonic() - started + 0.2), metadata=AS_TENANT)
        if profile.num_running == 0 and profile.num_requests > 0:
            break
        await asyncio.sleep(0.05)
    assert (profile.num_running, profile.kv_cache_usage) == (0, 0.0)
    # What the engine generated for it: the tokens the reply counted, and at most a step or two more.
    assert received <= profile.max_output_tokens <= received + 4 < 400


@pytest.mark.parametrize("stream", [False, True])
async def test_required_with_parallel_tool_calls_false_makes_one_call(stack, stream):
    request = dict(TWO_CALLS, tool_choice="required", parallel_tool_calls=False, stream=stream)
    reply = await stack.client.chat.completions.create(model="smol", **request)
    if not stream:
        [call] = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        json.loads(call.function.arguments)
        return
    indexes, finishes = set(), []
    async for chunk in reply:
        for choice in chunk.choices:
            indexes.update(d.index for d in choice.delta.tool_calls or ())
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert indexes == {0} and finishes == ["tool_calls"]
