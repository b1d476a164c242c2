"""OpenAI's Responses API on the gateway, through the official ``openai`` SDK, in front of a real
SmolLM2 engine (the kept Q4_1 chat model; tokenizer, executor, scheduler and gateway on loopback)
behind API keys: text and item input, instructions, max_output_tokens cutting the reply
(incomplete), a function call forced by tool_choice and its output sent back, each whole and
streamed (the SDK parses every event), the stateless refusals and the API key check."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import openai
import pytest
import pytest_asyncio

from services.common.server import RunningServer
from tests.helpers.gateway_stack import serve_engine, serve_gateway_for, stop_all, wait_healthy, write_routes
from tests.helpers.service_harness import REPO_ROOT

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

SMOLLM2_Q4_1 = REPO_ROOT / "models" / "smollm2-135m-instruct-q4_1"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


@dataclass
class Stack:
    servers: list[RunningServer]
    client: openai.AsyncOpenAI
    base_url: str


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[Stack]:
    assert (SMOLLM2_Q4_1 / "config.json").is_file(), f"{SMOLLM2_Q4_1} is absent: `make install` converts it"
    root = tmp_path_factory.mktemp("responses")
    keys = root / "keys.json"
    keys.write_text(json.dumps([{"key": "sk-test", "tenant": "t"}]))
    keys.chmod(0o600)
    engine = await serve_engine(model=SMOLLM2_Q4_1, num_blocks=64, max_model_len=1024)
    routes = write_routes(root / "routes.json", {"targets": [{"name": "e1", "address": engine[-1].address}],
                                                 "models": {"smol": "e1"}})
    gateway = await serve_gateway_for(routes, api_keys_file=str(keys))
    await wait_healthy(gateway, ["e1"])
    base_url = f"http://127.0.0.1:{gateway.http_port}/v1"
    client = openai.AsyncOpenAI(base_url=base_url, api_key="sk-test", max_retries=0, timeout=300)
    yield Stack([gateway, *reversed(engine)], client, base_url)
    await client.close()
    await stop_all([gateway, *reversed(engine)])


async def streamed(client: openai.AsyncOpenAI, **kwargs):
    """Every event the SDK parsed, and the final response it assembled."""
    async with client.responses.stream(**kwargs) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events))), numbers
    return [e.type for e in events], final


async def test_text_input_whole_and_streamed(stack):
    whole = await stack.client.responses.create(model="smol", input="What is the capital of France?",
                                                instructions="Answer in one short sentence.", temperature=0,
                                                max_output_tokens=24)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.output[0].type == "message" and whole.output_text.strip()
    assert whole.usage.input_tokens > 10 and 0 < whole.usage.output_tokens <= 24
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    kinds, final = await streamed(stack.client, model="smol", input="What is the capital of France?",
                                  instructions="Answer in one short sentence.", temperature=0, max_output_tokens=24)
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert "response.output_text.delta" in kinds
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == "response.completed"
    assert final.output_text == whole.output_text  # greedy: the same reply either way
    assert final.status == whole.status


async def test_item_input_and_max_output_tokens_incomplete(stack):
    items = [{"role": "developer", "content": "You are terse."},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "user", "content": "Write a long story about it."}]
    whole = await stack.client.responses.create(model="smol", input=items, max_output_tokens=3, temperature=0)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 3 and whole.output_text
    kinds, final = await streamed(stack.client, model="smol", input=items, max_output_tokens=3, temperature=0)
    assert kinds[-1] == "response.completed"
    assert final.status == "incomplete" and final.output_text == whole.output_text


async def test_forced_function_call_and_its_output(stack):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    whole = await stack.client.responses.create(model="smol", input=ask, tools=[WEATHER], temperature=0,
                                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    kinds, final = await streamed(stack.client, model="smol", input=ask, tools=[WEATHER], temperature=0,
                                  tool_choice={"type": "function", "name": "get_weather"})
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    (streamed_call,) = [item for item in final.output if item.type == "function_call"]
    assert streamed_call.arguments == call.arguments
    follow = ask + [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                    {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}]
    answer = await stack.client.responses.create(model="smol", input=follow, tools=[WEATHER], tool_choice="none",
                                                 temperature=0, max_output_tokens=32)
    assert answer.output_text.strip()


async def test_stateless_refusals_name_the_field(stack):
    with pytest.raises(openai.BadRequestError) as raised:
        await stack.client.responses.create(model="smol", input="hi", previous_response_id="resp_abc")
    assert raised.value.body["param"] == "previous_response_id" and "stateless" in raised.value.body["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        await stack.client.responses.create(model="smol", input="hi", store=True)
    assert raised.value.body["param"] == "store"
    with pytest.raises(openai.BadRequestError) as raised:
        await stack.client.responses.create(model="smol", input="hi", tools=[{"type": "web_search"}])
    assert raised.value.body["param"] == "tools[0].type"


async def test_api_keys_are_honoured(stack):
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            await wrong.responses.create(model="smol", input="hi", max_output_tokens=2)
