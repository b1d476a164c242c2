"""Structured outputs through the gateway with the official ``openai`` client, against a real
stories260K engine (tokenizer, executor and scheduler servers on loopback): response_format
json_schema and json_object, a named tool call streamed as OpenAI's deltas and assembled by the
client, tool_choice required, and refusals (a schema that does not compile, one that admits
nothing, one over max_grammar_bytes) as 400 with OpenAI's error body naming the field, while
another stream goes on undisturbed. The engine's own gRPC API refuses them as INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import jsonschema
import openai
import pytest
import pytest_asyncio

from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import RunningServer, create_channel
from services.scheduler.core.config import SchedulerLimits
from tests.helpers.gateway_stack import (
    serve_engine,
    serve_gateway_for,
    stop_all,
    stories_with_chat_template,
    wait_healthy,
    write_routes,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

MAX_GRAMMAR_BYTES = 2048
MESSAGES = [{"role": "user", "content": "Once upon a time"}]
CHARACTER = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 8},
    "age": {"type": "integer", "minimum": 1, "maximum": 99},
    "mood": {"enum": ["happy", "sad", "sleepy"]},
    "friends": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["name", "age", "mood", "friends"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@dataclass
class Stack:
    servers: list[RunningServer]
    client: openai.AsyncOpenAI
    engine: generation_pb2_grpc.GenerationStub


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[Stack]:
    root = tmp_path_factory.mktemp("structured")
    model = stories_with_chat_template(root)
    engine = await serve_engine(model=model, scheduler={"limits": SchedulerLimits(max_grammar_bytes=MAX_GRAMMAR_BYTES)})
    routes = write_routes(root / "routes.json", {"targets": [{"name": "e1", "address": engine[-1].address}],
                                                 "models": {"stories": "e1"}})
    gateway = await serve_gateway_for(routes)
    await wait_healthy(gateway, ["e1"])
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="none", max_retries=0,
                                timeout=120)
    async with create_channel(engine[-1].address) as channel:
        yield Stack([gateway, *reversed(engine)], client, generation_pb2_grpc.GenerationStub(channel))
    await client.close()
    await stop_all([gateway, *reversed(engine)])


def json_schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "character", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_response_format_json_schema_returns_json_that_validates(stack, temperature):
    reply = await stack.client.chat.completions.create(
        model="stories", messages=MESSAGES, max_tokens=300, temperature=temperature, seed=3,
        response_format=json_schema_format(CHARACTER))
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), CHARACTER)


async def test_response_format_json_object_streams_an_object(stack):
    stream = await stack.client.chat.completions.create(
        model="stories", messages=MESSAGES, max_tokens=300, temperature=0.0, stream=True,
        response_format={"type": "json_object"}, stop=None)
    text, finish = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert finish == "length" and text.startswith("{")


async def test_a_named_tool_call_streams_deltas_the_client_assembles(stack):
    stream = await stack.client.chat.completions.create(
        model="stories", messages=MESSAGES, max_tokens=200, temperature=0.0, stream=True, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    names, ids, types, pieces, finishes = [], set(), set(), [], []
    async for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for call in choice.delta.tool_calls or ():
                assert call.index == 0
                if call.id is not None:
                    ids.add(call.id)
                if call.type is not None:
                    types.add(call.type)
                if call.function.name is not None:
                    names.append(call.function.name)
                pieces.append(call.function.arguments or "")
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert names == ["get_weather"] and len(ids) == 1 and types == {"function"}
    assert finishes == ["tool_calls"]
    assert len([p for p in pieces if p]) > 1  # the arguments came in pieces
    jsonschema.validate(json.loads("".join(pieces)), WEATHER["function"]["parameters"])


async def test_tool_choice_required_calls_one_of_the_tools(stack):
    reply = await stack.client.chat.completions.create(
        model="stories", messages=MESSAGES, max_tokens=200, temperature=0.0, tools=[WEATHER, TIME],
        tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.type == "function" and call.id


async def test_a_required_tool_call_streams_its_name_once(stack):
    stream = await stack.client.chat.completions.create(
        model="stories", messages=MESSAGES, max_tokens=200, temperature=0.0, stream=True, tools=[WEATHER, TIME],
        tool_choice="required")
    names, pieces = [], []
    async for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                if call.function.name is not None:
                    names.append(call.function.name)
                pieces.append(call.function.arguments or "")
    (name,) = names
    tool = {"get_weather": WEATHER, "get_time": TIME}[name]
    jsonschema.validate(json.loads("".join(pieces)), tool["function"]["parameters"])


async def streamed_calls(stream) -> tuple[dict, list[str], set]:
    """A streamed choice's calls as the client assembles them ({index: [name, arguments]}), its
    finish reasons and whether any content came."""
    calls, finishes, contents = {}, [], set()
    async for chunk in stream:
        for choice in chunk.choices:
            contents.add(choice.delta.content)
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return calls, finishes, contents


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice,max_tokens", [("required", 30), ("required", 36), (NAMED, 6), (NAMED, 16)])
async def test_a_tool_call_cut_by_max_tokens_is_a_partial_call_in_both_shapes(stack, tool_choice, max_tokens):
    args = dict(model="stories", messages=MESSAGES, max_tokens=max_tokens, temperature=0.0, tools=[WEATHER, TIME],
                tool_choice=tool_choice)
    whole = await stack.client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and call.function.arguments.startswith("{")
    with pytest.raises(json.JSONDecodeError):  # cut: not yet whole JSON
        json.loads(call.function.arguments)
    calls, finishes, contents = await streamed_calls(await stack.client.chat.completions.create(**args, stream=True))
    assert calls == {0: [call.function.name, call.function.arguments]}
    assert finishes == ["length"] and contents == {None}


async def test_a_required_call_cut_before_its_name_has_neither_content_nor_calls_in_both_shapes(stack):
    args = dict(model="stories", messages=MESSAGES, max_tokens=3, temperature=0.0, tools=[WEATHER, TIME],
                tool_choice="required")
    choice = (await stack.client.chat.completions.create(**args)).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None and not choice.message.tool_calls
    calls, finishes, contents = await streamed_calls(await stack.client.chat.completions.create(**args, stream=True))
    assert calls == {} and finishes == ["length"] and contents == {None}


@pytest.mark.parametrize("response_format,message", [
    (json_schema_format({"type": "integer", "minimum": 5, "maximum": 1}),
     "response_format.json_schema.schema: does not compile: Unsatisfiable schema: minimum (5) is greater than "
     "maximum (1)"),
    (json_schema_format({"type": "string", "pattern": "[^\\x00-\\U0010FFFF]"}), "Regex is empty"),
    (json_schema_format({"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(80)}}),
     f"the limit is max_grammar_bytes={MAX_GRAMMAR_BYTES}"),
])
async def test_bad_schemas_are_400_naming_the_field_while_another_stream_goes_on(stack, response_format, message):
    long = await stack.client.chat.completions.create(model="stories", messages=MESSAGES, max_tokens=120,
                                                      temperature=0.0, stream=True)
    first = await anext(aiter(long))
    with pytest.raises(openai.BadRequestError) as caught:
        await stack.client.chat.completions.create(model="stories", messages=MESSAGES, max_tokens=20,
                                                   response_format=response_format)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == "response_format.json_schema.schema"
    assert message in error["message"] and error["type"] == "invalid_request_error"
    rest = [chunk async for chunk in long]
    assert first.choices and rest[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("fields,param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
async def test_bad_tool_and_format_fields_are_400(stack, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        await stack.client.chat.completions.create(model="stories", messages=MESSAGES, max_tokens=5, **fields)
    assert caught.value.body["param"] == param, caught.value.body


@pytest.mark.parametrize("structured,message", [
    (generation_pb2.StructuredOutput(regex="a(b"), "structured_output.regex does not compile"),
    (generation_pb2.StructuredOutput(grammar="start: nothing_here"), "structured_output.grammar does not compile"),
    (generation_pb2.StructuredOutput(regex="[^\\x00-\\U0010FFFF]"), "structured_output.regex admits no output"),
    (generation_pb2.StructuredOutput(choice=generation_pb2.Choice()), "structured_output.choice has no options"),
])
async def test_the_engine_refuses_bad_structured_outputs_as_invalid_argument(stack, structured, message):
    request = generation_pb2.GenerateRequest(text="Once upon a time", structured_output=structured)
    request.stop.max_tokens = 5
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stack.engine.Generate(request, timeout=30):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in caught.value.details()


async def test_the_engine_api_constrains_to_a_choice(stack):
    request = generation_pb2.GenerateRequest(
        text="Once upon a time", structured_output=generation_pb2.StructuredOutput(
            choice=generation_pb2.Choice(options=["the cat", "a dog", "Lily"])))
    request.sampling.temperature = 1.0
    texts = []
    for seed in range(4):
        request.sampling.seed = seed
        text = ""
        async for reply in stack.engine.Generate(request, timeout=30):
            if reply.WhichOneof("event") == "delta":
                text += reply.delta.text
        texts.append(text)
    assert set(texts) <= {"the cat", "a dog", "Lily"}, texts
