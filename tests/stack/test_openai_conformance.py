"""OpenAI-API conformance: the core of OpenAI's API as the official `openai` client exercises
it (sync and async), against one stack started exactly as `make run` starts it (its recipe from
the repository's root, the relative model path, ports moved only by the documented variables).

What tokenmill does not support is asserted as the clear 400 it is documented to be (OpenAI's
error body naming the `param`), so a gap cannot pass as a success nor a success hide as a gap.
Greedy and a few tokens each, so the module runs in well under a minute once the stack is up.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from pydantic import BaseModel
from tokenizers import Tokenizer

from tests.helpers import typed_up
from tests.helpers.service_harness import REPO_ROOT

pytestmark = pytest.mark.slow

MODEL = typed_up.MAKE_RUN_MODEL
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}
# strict, as OpenAI's structured tool calls: the arguments match the schema exactly (a loose schema
# lets a small model add keys of its own, as it may on OpenAI)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                            "parameters": CITY, "strict": True}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city.",
                                         "parameters": CITY, "strict": True}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with typed_up.make_run_stack(tmp_path_factory.mktemp("logs")) as (up, env):
        yield f"http://127.0.0.1:{env['TOKENMILL_GATEWAY_HTTP_PORT']}/v1"


@pytest.fixture(scope="module")
def client(stack):
    # max_retries=0: a 429/5xx must show here, not be retried away
    with openai.OpenAI(base_url=stack, api_key="unused-without-tenants", max_retries=0, timeout=120) as c:
        yield c


def _bad_request(call, param: str) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as raised:
        call()
    error = raised.value
    assert error.status_code == 400
    assert error.body["type"] == "invalid_request_error" and error.body["message"], error.body
    assert error.param == param, error.body
    return error


# -- models ------------------------------------------------------------------------------------

def test_models_list_and_retrieve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model" and models.data[0].owned_by
    one = client.models.retrieve(MODEL)
    assert one.id == MODEL and one.object == "model" and isinstance(one.created, int)


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("gpt-4o")
    assert raised.value.status_code == 404 and raised.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert raised.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)


# -- completions -------------------------------------------------------------------------------

def test_completion_shape_and_greedy_determinism(client):
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert first.object == "text_completion" and first.model == MODEL and first.id.startswith("cmpl")
    assert isinstance(first.created, int)
    (choice,) = first.choices
    assert choice.index == 0 and choice.finish_reason in ("length", "stop") and choice.text
    assert first.usage.completion_tokens <= 6 and first.usage.prompt_tokens > 0
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert [c.text for c in again.choices] == [choice.text]


def test_completion_prompt_forms(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    listed = client.completions.create(model=MODEL, prompt=[PROMPT, "Once upon a time"], max_tokens=4,
                                       temperature=0)
    assert sorted(c.index for c in listed.choices) == [0, 1]
    assert listed.choices[0].text == text.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.choices[0].text
    id_lists = client.completions.create(model=MODEL, prompt=[[504, 3575], [504]], max_tokens=2, temperature=0)
    assert len(id_lists.choices) == 2


def test_completion_max_tokens_bounds_the_answer(client):
    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0)
    assert done.usage.completion_tokens == 3 and done.choices[0].finish_reason == "length"


def test_completion_n_and_seed(client):
    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, n=3, temperature=1,
                                     seed=7)
    assert sorted(c.index for c in done.choices) == [0, 1, 2]
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, n=3, temperature=1,
                                      seed=7)
    assert [c.text for c in again.choices] == [c.text for c in done.choices]
    assert done.usage.completion_tokens == 15


def test_completion_best_of(client):
    try:
        done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=1, best_of=2, temperature=0)
    except openai.BadRequestError as error:  # not supported: it must say so and name it
        assert error.param == "best_of", error.body
    else:
        assert len(done.choices) == 1 and done.choices[0].text
    _bad_request(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=3, best_of=2),
                 "best_of")


def test_completion_stop_string_and_list(client):
    free = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0]
    word = free.text.strip().split(",")[1].strip()  # the second number it writes
    assert word, free.text
    one = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=word)
    assert one.choices[0].finish_reason == "stop" and word not in one.choices[0].text
    assert free.text.startswith(one.choices[0].text)
    several = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                        stop=["nothing like it", word])
    assert several.choices[0].text == one.choices[0].text and several.choices[0].finish_reason == "stop"


def test_completion_echo_and_logprobs(client):
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                     logprobs=2)
    (choice,) = done.choices
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    generated = lp.top_logprobs[-1]
    assert 1 <= len(generated) <= 3 and lp.tokens[-1] in generated  # top 2 plus the sampled token
    # greedy: the sampled token is the most likely one
    assert max(generated.values()) == pytest.approx(lp.token_logprobs[-1], abs=1e-4)


def test_completion_echo_only_scores_the_prompt(client):
    # OpenAI's scoring call: echo, logprobs, max_tokens 0 (the prompt and its logprobs, nothing written)
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    with_one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1,
                                         temperature=0)
    (choice,) = scored.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == with_one.usage.prompt_tokens
    lp = choice.logprobs
    assert "".join(lp.tokens) == PROMPT and lp.token_logprobs[0] is None
    assert lp.token_logprobs == pytest.approx(with_one.choices[0].logprobs.token_logprobs[:-1], abs=1e-4)
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["length"]
    assert streamed[-1].usage.completion_tokens == 0
    assert [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] \
        == lp.tokens
    # nothing to write and nothing to show is no request
    _bad_request(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0), "max_tokens")


def test_completion_suffix_is_a_clear_400(client):
    _bad_request(lambda: client.completions.create(model=MODEL, prompt=PROMPT, suffix=" and that is all.",
                                                   max_tokens=3), "suffix")


def test_completion_penalties_logit_bias_user(client):
    plain = client.completions.create(model=MODEL, prompt="the the the the", max_tokens=6, temperature=0)
    penalized = client.completions.create(model=MODEL, prompt="the the the the", max_tokens=6, temperature=0,
                                          presence_penalty=2.0, frequency_penalty=2.0, user="conformance")
    assert penalized.usage.completion_tokens == 6 and penalized.choices[0].text != plain.choices[0].text
    vocab = Tokenizer.from_file(str(REPO_ROOT / "models" / MODEL / "tokenizer.json"))
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0).choices[0].text
    (greedy_id,) = vocab.encode(greedy, add_special_tokens=False).ids
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(greedy_id): -100})
    assert banned.choices[0].text not in ("", greedy)
    forced_id = vocab.encode(" London", add_special_tokens=False).ids[0]
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == vocab.decode([forced_id])


def test_completion_stream_with_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert all(c.usage is None for c in body) and all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in body) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["length"]
    _bad_request(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                   stream_options={"include_usage": True}), "stream_options")


# -- chat completions --------------------------------------------------------------------------

def test_chat_shape_roles_and_multi_turn(client):
    done = client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "You are a helpful assistant."}, *QUESTION], max_tokens=12, temperature=0)
    assert done.object == "chat.completion" and done.id.startswith("chatcmpl") and done.model == MODEL
    (choice,) = done.choices
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    follow = client.chat.completions.create(model=MODEL, messages=[
        *QUESTION, {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"}], max_tokens=12, temperature=0)
    assert "Rome" in follow.choices[0].message.content
    assert follow.usage.prompt_tokens > done.usage.prompt_tokens - 20


def test_chat_n_stop_and_finish_reasons(client):
    done = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, n=2, temperature=0)
    assert sorted(c.index for c in done.choices) == [0, 1]
    assert done.choices[0].message.content == done.choices[1].message.content
    assert {c.finish_reason for c in done.choices} == {"length"} and done.usage.completion_tokens == 8
    stopped = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0,
                                             stop=["Paris"])
    assert stopped.choices[0].finish_reason == "stop" and "Paris" not in stopped.choices[0].message.content
    listed = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0,
                                            stop=["Zanzibar", "Paris"])
    assert listed.choices[0].message.content == stopped.choices[0].message.content
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    assert whole.choices[0].finish_reason == "stop"  # the model's end of turn


def test_chat_max_tokens_and_max_completion_tokens(client):
    old = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0)
    new = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=3, temperature=0)
    assert old.usage.completion_tokens == new.usage.completion_tokens == 3
    assert old.choices[0].message.content == new.choices[0].message.content


def test_chat_logprobs(client):
    done = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == done.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3 and token.bytes == list(token.token.encode())
        assert token.top_logprobs[0].token == token.token  # greedy
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs),
                                                                 reverse=True)
    _bad_request(lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                                        top_logprobs=3), "top_logprobs")


def test_chat_response_format(client):
    obj = client.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, messages=[
        {"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason in ("stop", "length")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"], "additionalProperties": False}
    strict = client.chat.completions.create(model=MODEL, max_tokens=30, temperature=0, messages=QUESTION,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "capital", "strict": True, "schema": schema}})
    assert strict.choices[0].finish_reason == "stop", strict
    assert set(json.loads(strict.choices[0].message.content)) == {"capital"}


class Capital(BaseModel):
    capital: str


def test_chat_parse_into_a_pydantic_model(client):
    # the client's structured-output helper: a pydantic model sent as a strict json_schema, the reply parsed
    done = client.chat.completions.parse(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0,
                                         response_format=Capital)
    assert done.choices[0].message.parsed == Capital(capital="Paris")
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert raw.status_code == 200 and raw.headers["x-request-id"] and raw.parse().choices[0].message.content


def test_chat_tools_and_tool_choice(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    required = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, TIME], max_tokens=40,
                                              temperature=0, tool_choice="required", parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id and call.function.name in ("get_weather", "get_time")
    assert set(json.loads(call.function.arguments)) == {"city"}
    named = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, TIME], max_tokens=40,
                                           temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and named.choices[0].finish_reason == "tool_calls"
    none = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], max_tokens=8,
                                          temperature=0, tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    auto = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], max_tokens=40,
                                          temperature=0, tool_choice="auto")
    message = auto.choices[0].message
    assert (message.tool_calls is None) == (auto.choices[0].finish_reason != "tool_calls")
    # the call answered: a tool message in the conversation
    follow = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=[WEATHER], messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}])
    assert follow.choices[0].message.content
    _bad_request(lambda: client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], max_tokens=4,
                                                        tool_choice={"type": "function",
                                                                     "function": {"name": "nope"}}), "tool_choice")


def test_chat_stream_chunks(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0)
    *body, last = chunks
    assert all(c.object == "chat.completion.chunk" for c in chunks) and len({c.id for c in chunks}) == 1
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["length"]
    assert last.choices == [] and last.usage.completion_tokens == 5 and all(c.usage is None for c in body)
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    # n choices streamed: each opens with the role, ends once, and one usage chunk counts them all
    both = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0, n=2,
                                               stream=True, stream_options={"include_usage": True}))
    for index in (0, 1):
        own = [c.choices[0] for c in both if c.choices and c.choices[0].index == index]
        assert own[0].delta.role == "assistant" and [c.finish_reason for c in own if c.finish_reason] == ["length"]
    assert both[-1].choices == [] and both[-1].usage.completion_tokens == 4
    # a streamed tool call: the name first, then arguments that join to JSON
    tool_chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER], max_tokens=40,
        temperature=0, tool_choice="required", stream=True))
    deltas = [t for c in tool_chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id and deltas[0].index == 0
    assert set(json.loads("".join(d.function.arguments or "" for d in deltas))) == {"city"}
    assert [c.choices[0].finish_reason for c in tool_chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"]


# -- errors ------------------------------------------------------------------------------------

def test_bad_parameters_are_400s_naming_the_param(client):
    _bad_request(lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=3),
                 "temperature")
    _bad_request(lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=-1),
                 "max_tokens")
    _bad_request(lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, n=0), "n")
    _bad_request(lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, top_p=1.5), "top_p")
    _bad_request(lambda: client.chat.completions.create(model=MODEL, messages=[], max_tokens=2), "messages")
    _bad_request(lambda: client.completions.create(model=MODEL, prompt=PROMPT, logprobs=99, max_tokens=2),
                 "logprobs")
    _bad_request(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                   presence_penalty=5), "presence_penalty")
    _bad_request(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                   logit_bias={"504": 500}), "logit_bias.504")
    _bad_request(lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                                        extra_body={"not_a_field": 1}), "not_a_field")
    with pytest.raises(openai.APIStatusError) as raised:  # a context no model has
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10**7)
    assert raised.value.status_code == 400 and raised.value.param == "max_tokens", raised.value.body


# -- the async client --------------------------------------------------------------------------

def test_async_client(stack):
    async def main():
        async with openai.AsyncOpenAI(base_url=stack, api_key="unused-without-tenants", max_retries=0,
                                      timeout=120) as client:
            models = client.models.list()
            assert [m.id async for m in models] == [MODEL]
            assert (await client.models.retrieve(MODEL)).id == MODEL
            chats = await asyncio.gather(*(client.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=4, temperature=0) for _ in range(3)))
            assert len({c.choices[0].message.content for c in chats}) == 1
            stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                                     stream=True, stream_options={"include_usage": True})
            pieces = [c async for c in stream]
            assert pieces[-1].usage.completion_tokens == 4
            whole = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
            assert "".join(c.choices[0].text for c in pieces[:-1]) == whole.choices[0].text
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)
            with pytest.raises(openai.BadRequestError) as raised:
                await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-1)
            assert raised.value.param == "temperature"

    asyncio.run(main())
