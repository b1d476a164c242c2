"""LangChain's OpenAI chat model against the gateway in front of a real SmolLM2 engine (the
kept Q4_1 chat model; tokenizer, executor, scheduler and gateway on loopback): the three ways
``with_structured_output`` asks for an object (``json_schema``: response_format with a strict
schema; ``function_calling``: a named tool_choice; ``json_mode``: a JSON object) and
``bind_tools(tool_choice="required")``, each invoked whole and streamed. What the framework
gets back must parse into what it asked for, with no None and no missing call."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

import pytest
import pytest_asyncio
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from services.common.server import RunningServer
from tests.helpers.gateway_stack import serve_engine, serve_gateway_for, stop_all, wait_healthy, write_routes
from tests.helpers.service_harness import REPO_ROOT

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

SMOLLM2_Q4_1 = REPO_ROOT / "models" / "smollm2-135m-instruct-q4_1"
QUESTION = "What is the weather like in Paris today? Answer in celsius."


class Weather(BaseModel):
    """The weather asked for."""

    city: str = Field(description="the city", min_length=1, max_length=12)
    unit: Literal["celsius", "fahrenheit"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                   "additionalProperties": False}}}


@dataclass
class Stack:
    servers: list[RunningServer]
    model: ChatOpenAI


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[Stack]:
    assert (SMOLLM2_Q4_1 / "config.json").is_file(), f"{SMOLLM2_Q4_1} is absent: `make install` converts it"
    root = tmp_path_factory.mktemp("langchain")
    engine = await serve_engine(model=SMOLLM2_Q4_1, num_blocks=64, max_model_len=1024)
    routes = write_routes(root / "routes.json", {"targets": [{"name": "e1", "address": engine[-1].address}],
                                                 "models": {"smol": "e1"}})
    gateway = await serve_gateway_for(routes)
    await wait_healthy(gateway, ["e1"])
    model = ChatOpenAI(model="smol", base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="none",
                       temperature=0, max_tokens=64, max_retries=0, timeout=300)
    yield Stack([gateway, *reversed(engine)], model)
    await stop_all([gateway, *reversed(engine)])


async def last_of(stream) -> object:
    last = None
    async for item in stream:
        last = item
    return last


@pytest.mark.parametrize("streamed", [False, True], ids=["invoke", "stream"])
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
async def test_structured_output_parses_into_the_model(stack, method, streamed):
    structured = stack.model.with_structured_output(Weather, method=method)
    got = await (last_of(structured.astream(QUESTION)) if streamed else structured.ainvoke(QUESTION))
    if streamed and isinstance(got, dict):  # some methods stream dicts, the last one whole
        got = Weather.model_validate(got)
    assert isinstance(got, Weather), got
    assert got.city and got.unit in ("celsius", "fahrenheit")


@pytest.mark.parametrize("streamed", [False, True], ids=["invoke", "stream"])
async def test_structured_output_json_mode_is_a_json_object(stack, streamed):
    structured = stack.model.with_structured_output(method="json_mode")
    prompt = QUESTION + ' Reply with a JSON object like {"city": ..., "unit": ...}.'
    got = await (last_of(structured.astream(prompt)) if streamed else structured.ainvoke(prompt))
    assert isinstance(got, dict) and got, got


@pytest.mark.parametrize("streamed", [False, True], ids=["invoke", "stream"])
async def test_bind_tools_required_makes_a_call(stack, streamed):
    bound = stack.model.bind_tools([WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    if streamed:
        message = None
        async for chunk in bound.astream(QUESTION):
            message = chunk if message is None else message + chunk
    else:
        message = await bound.ainvoke(QUESTION)
    (call,) = message.tool_calls
    assert call["name"] in ("get_weather", "get_time") and call["id"], message
    schema = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call["name"]]["function"]["parameters"]
    assert set(call["args"]) == set(schema["required"]), call
    assert json.dumps(call["args"])


@pytest.mark.parametrize("streamed", [False, True], ids=["invoke", "stream"])
async def test_a_call_cut_by_max_tokens_reaches_the_framework_as_a_cut_call(stack, streamed):
    short = stack.model.model_copy(update={"max_tokens": 6})  # the whole call takes 13 tokens
    if streamed:
        raw = None
        async for chunk in short.bind_tools([Weather], tool_choice="Weather").astream(QUESTION):
            raw = chunk if raw is None else raw + chunk
    else:
        structured = short.with_structured_output(Weather, method="function_calling", include_raw=True)
        raw = (await structured.ainvoke(QUESTION))["raw"]
    assert raw.response_metadata["finish_reason"] == "length", raw
    assert not raw.content
    # The call, its arguments partial JSON: invalid whole; streamed, LangChain reads the pieces
    # leniently (partial JSON) into a call.
    (cut,) = raw.invalid_tool_calls + raw.tool_calls
    assert cut["name"] == "Weather" and cut["id"], raw
