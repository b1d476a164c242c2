"""Anthropic's Messages API with the official ``anthropic`` client, against the gateway in front of
a real SmolLM2 engine (the kept Q4_1 chat model; tokenizer, executor, scheduler and gateway on
loopback, the gateway's API keys on: the client's ``x-api-key`` is one of them).

Each answer is checked against the same request through the OpenAI chat endpoint (greedy, so the
two must agree token for token): the text, the usage, the stop reason (end_turn, max_tokens,
stop_sequence with the string that matched, tool_use); system prompts as a string or blocks;
the streamed events in Anthropic's exact order with the same text and usage; count_tokens equal to
the chat prompt's tokens, tools and a tool_use/tool_result history included (the history reaches
the template as the chat path's tool_calls and tool turns); a call forced with tool_choice
``{"type": "tool"}``, streamed and not; tool_choice auto reading the call the model wrote after two
worked tool_use examples (streamed: the same blocks), any forcing a call, none leaving text; and
refusals in Anthropic's envelope (missing max_tokens,
an unknown model, a wrong key)."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anthropic
import openai
import pytest
import pytest_asyncio

from services.common.server import RunningServer
from tests.helpers.gateway_stack import serve_engine, serve_gateway_for, stop_all, wait_healthy, write_routes
from tests.helpers.service_harness import REPO_ROOT
from tests.helpers.tool_templates import HERMES_TEMPLATE

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

SMOLLM2_Q4_1 = REPO_ROOT / "models" / "smollm2-135m-instruct-q4_1"
GREEDY = {"temperature": 0}
"""The SDK no longer has a temperature argument; the API still takes the field."""
KEY = "sk-anthropic-test-0123456789"
SYSTEM = "You are a helpful assistant who answers briefly."
QUESTION = "Name three colours of the rainbow."
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1,
                                                                       "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}
OPENAI_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                   "parameters": WEATHER["input_schema"]}}


@dataclass
class Stack:
    servers: list[RunningServer]
    client: anthropic.AsyncAnthropic
    chat: openai.AsyncOpenAI
    base_url: str


def q4_1_with_hermes_template(root) -> str:
    """The Q4_1 model with a template that renders tools, calls and tool results (its own ignores
    them), so that the prompt shows how a tool_use/tool_result history was translated."""
    target = root / "smollm2-q4_1-hermes"
    target.mkdir()
    for path in SMOLLM2_Q4_1.iterdir():
        if path.name == "model.safetensors":
            (target / path.name).symlink_to(path.resolve())
        elif path.is_file():
            shutil.copy(path, target / path.name)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return str(target)


async def raw_event_names(stack: Stack, **request) -> list[str]:
    """The ``event:`` lines of a streamed answer as sent (the SDK's iterator drops ``ping``)."""
    async with stack.client.messages.with_streaming_response.create(**request, stream=True) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line[len("event: "):] async for line in response.iter_lines() if line.startswith("event: ")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[Stack]:
    assert (SMOLLM2_Q4_1 / "config.json").is_file(), f"{SMOLLM2_Q4_1} is absent: `make install` converts it"
    root = tmp_path_factory.mktemp("anthropic")
    keys = root / "keys.json"
    keys.write_text(json.dumps([{"key": KEY, "tenant": "alpha"}]))
    keys.chmod(0o600)
    engine = await serve_engine(model=q4_1_with_hermes_template(root), num_blocks=64, max_model_len=1024)
    routes = write_routes(root / "routes.json", {"targets": [{"name": "e1", "address": engine[-1].address}],
                                                 "models": {"smol": "e1"}})
    gateway = await serve_gateway_for(routes, api_keys_file=str(keys))
    await wait_healthy(gateway, ["e1"])
    base_url = f"http://127.0.0.1:{gateway.http_port}"
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=300)
    chat = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=300)
    yield Stack([gateway, *reversed(engine)], client, chat, base_url)
    await client.close()
    await chat.close()
    await stop_all([gateway, *reversed(engine)])


async def chat_reference(stack: Stack, max_tokens: int, **extra) -> openai.types.chat.ChatCompletion:
    return await stack.chat.chat.completions.create(
        model="smol", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        temperature=0, max_tokens=max_tokens, **extra)


async def test_create_answers_as_the_chat_path_does(stack):
    reference = await chat_reference(stack, 12)
    message = await stack.client.messages.create(model="smol", max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                                 messages=[{"role": "user", "content": QUESTION}],
                                                 metadata={"user_id": "u-1"})
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == "smol"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == reference.choices[0].message.content and message.content[0].text
    assert reference.choices[0].finish_reason == "length"
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.input_tokens == reference.usage.prompt_tokens > 10
    assert message.usage.output_tokens == reference.usage.completion_tokens == 12
    # system and content as text blocks: the same prompt, the same reply
    blocks = await stack.client.messages.create(
        model="smol", max_tokens=12, extra_body=GREEDY, system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
    assert blocks.content[0].text == message.content[0].text
    assert blocks.usage.input_tokens == message.usage.input_tokens


async def test_end_turn_and_stop_sequence(stack):
    reference = await chat_reference(stack, 200)
    assert reference.choices[0].finish_reason == "stop"
    whole = await stack.client.messages.create(model="smol", max_tokens=200, extra_body=GREEDY, system=SYSTEM,
                                               messages=[{"role": "user", "content": QUESTION}])
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None
    assert whole.content[0].text == reference.choices[0].message.content
    text = whole.content[0].text
    words = text.split()
    stop = words[min(2, len(words) - 1)]
    cut = await stack.client.messages.create(model="smol", max_tokens=200, extra_body=GREEDY, system=SYSTEM,
                                             messages=[{"role": "user", "content": QUESTION}],
                                             stop_sequences=["zzqx-never", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


async def test_stream_events_come_in_anthropics_order(stack):
    whole = await stack.client.messages.create(model="smol", max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                               messages=[{"role": "user", "content": QUESTION}])
    stream = await stack.client.messages.create(model="smol", max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                                messages=[{"role": "user", "content": QUESTION}], stream=True)
    events = [event async for event in stream]
    names = await raw_event_names(stack, model="smol", max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                  messages=[{"role": "user", "content": QUESTION}])
    assert names[:3] == ["message_start", "content_block_start", "ping"], names
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"], names
    assert set(names[3:-3]) == {"content_block_delta"}, names
    assert [event.type for event in events] == [name for name in names if name != "ping"]
    assert events[0].message.id.startswith("msg_") and events[0].message.role == "assistant"
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens > 10
    assert events[1].content_block.type == "text" and events[1].index == 0
    assert all(event.delta.type == "text_delta" and event.index == 0 for event in events[2:-3])
    assert "".join(event.delta.text for event in events[2:-3]) == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12
    # the SDK's stream helper puts the message together, the input tokens from message_delta
    async with stack.client.messages.stream(model="smol", max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                            messages=[{"role": "user", "content": QUESTION}]) as helper:
        final = await helper.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


async def test_count_tokens_is_the_chat_prompts_length(stack):
    reference = await chat_reference(stack, 1)
    counted = await stack.client.messages.count_tokens(model="smol", system=SYSTEM,
                                                       messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == reference.usage.prompt_tokens
    # a tool_use / tool_result history: the chat path's tool_calls and tool turn, token for token
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": [
                   {"type": "text", "text": "Let me look."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C and sunny"},
                   {"type": "text", "text": "And is that warm?"}]}]
    chat_history = [{"role": "user", "content": "What is the weather in Paris?"},
                    {"role": "assistant", "content": "Let me look.", "tool_calls": [
                        {"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                    {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C and sunny"},
                    {"role": "user", "content": "And is that warm?"}]
    counted = await stack.client.messages.count_tokens(model="smol", messages=history, tools=[WEATHER])
    reference = await stack.chat.chat.completions.create(model="smol", messages=chat_history,
                                                         tools=[OPENAI_WEATHER], max_tokens=1)
    assert counted.input_tokens == reference.usage.prompt_tokens
    plain = await stack.client.messages.count_tokens(model="smol", messages=history)
    assert counted.input_tokens > plain.input_tokens + 60  # the tools are in the prompt
    without_call = [history[0], {"role": "assistant", "content": "Let me look."}, history[2]]
    fewer = await stack.client.messages.count_tokens(model="smol", messages=without_call)
    assert plain.input_tokens > fewer.input_tokens + 10  # the call is in the prompt
    answer = await stack.client.messages.create(model="smol", max_tokens=4, extra_body=GREEDY, messages=history,
                                                tools=[WEATHER])
    assert answer.usage.input_tokens == counted.input_tokens


async def test_a_forced_tool_call_is_a_tool_use_block(stack):
    request = dict(model="smol", max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
                   tool_choice={"type": "tool", "name": "get_weather"},
                   messages=[{"role": "user", "content": "What is the weather like in Paris today?"}])
    message = await stack.client.messages.create(**request)
    assert message.stop_reason == "tool_use"
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id
    assert isinstance(calls[0].input["city"], str) and 1 <= len(calls[0].input["city"]) <= 12
    reference = await stack.chat.chat.completions.create(
        model="smol", messages=request["messages"], tools=[OPENAI_WEATHER], temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(reference.choices[0].message.tool_calls[0].function.arguments) == calls[0].input
    # streamed: a tool_use block whose input comes as input_json_delta pieces
    stream = await stack.client.messages.create(**request, stream=True)
    events = [event async for event in stream]
    names = await raw_event_names(stack, **request)
    assert names[:3] == ["message_start", "content_block_start", "ping"], names
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"], names
    assert [event.type for event in events] == [name for name in names if name != "ping"]
    assert events[1].content_block.type == "tool_use" and events[1].content_block.name == "get_weather"
    pieces = [event.delta.partial_json for event in events[2:-3]]
    assert all(event.delta.type == "input_json_delta" for event in events[2:-3])
    assert json.loads("".join(pieces)) == calls[0].input
    assert events[-2].delta.stop_reason == "tool_use"


async def test_refusals_come_in_anthropics_envelope(stack):
    with pytest.raises(anthropic.BadRequestError) as missing:
        await stack.client.messages.create(model="smol", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=anthropic.NOT_GIVEN)
    assert missing.value.body["type"] == "error"
    assert missing.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as choice:
        await stack.client.messages.create(model="smol", max_tokens=4, tools=[WEATHER],
                                           tool_choice={"type": "tool", "name": "nope"},
                                           messages=[{"role": "user", "content": "hi"}])
    assert "tool_choice.name" in choice.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        await stack.client.messages.create(model="no-such-model", max_tokens=4,
                                           messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.AsyncAnthropic(base_url=stack.base_url, api_key="sk-wrong-0123456789", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await wrong.messages.create(model="smol", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    await wrong.close()
    assert refused.value.body["error"]["type"] == "authentication_error"


def worked_call(city: str, number: int) -> list[dict]:
    """A question and the assistant's tool_use for it."""
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{number}", "name": "get_weather",
                                               "input": {"city": city}}]}]


async def test_tool_choice_auto_and_any_make_tool_use_blocks(stack):
    # Two worked examples in the history (tool_use blocks, rendered by the template as <tool_call>
    # blocks): greedy decoding calls the tool the same way, and the gateway's parser reads the call
    # out of the reply.
    messages = [*worked_call("Rome", 1), *worked_call("Oslo", 2),
                {"role": "user", "content": "What is the weather in Paris?"}]
    auto = await stack.client.messages.create(model="smol", max_tokens=48, extra_body=GREEDY, tools=[WEATHER],
                                              tool_choice={"type": "auto"}, messages=messages)
    calls = [block for block in auto.content if block.type == "tool_use"]
    assert auto.stop_reason == "tool_use", auto.content
    assert [(call.name, call.input) for call in calls] == [("get_weather", {"city": "Paris"})]
    async with stack.client.messages.stream(model="smol", max_tokens=48, extra_body=GREEDY, tools=[WEATHER],
                                            tool_choice={"type": "auto"}, messages=messages) as stream:
        streamed = await stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in streamed.content] == \
        [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in auto.content]
    assert streamed.usage.output_tokens == auto.usage.output_tokens
    # any: a call is required, constrained to one of the tools
    forced = await stack.client.messages.create(model="smol", max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
                                                tool_choice={"type": "any"},
                                                messages=[{"role": "user", "content": "Hello there!"}])
    assert forced.stop_reason == "tool_use"
    assert [block.type for block in forced.content] == ["tool_use"] and forced.content[0].name == "get_weather"
    # none: text only, with the tools in the prompt
    none = await stack.client.messages.create(model="smol", max_tokens=8, extra_body=GREEDY, tools=[WEATHER],
                                              tool_choice={"type": "none"}, messages=messages)
    assert [block.type for block in none.content] == ["text"] and none.stop_reason in ("end_turn", "max_tokens")
