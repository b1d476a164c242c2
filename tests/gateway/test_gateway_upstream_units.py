"""HTTP upstream targets without processes: the routes file's kinds, the passive profile's window
and seed, and the translations of a GenerateRequest and of the upstreams' streamed events."""

from __future__ import annotations

import json
import math
import re

import grpc
import pytest
from tokenizers import Tokenizer

from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2
from services.gateway.http.engine_request import chat_template
from services.gateway.http.protocol import ChatCompletionRequest
from services.gateway.routes_file import SeedProfile, load_routes, parse_routes
from services.gateway.routing.passive_profile import PassiveProfile
from services.gateway.upstreams import anthropic as anthropic_dialect
from services.gateway.upstreams import openai as openai_dialect
from services.gateway.upstreams.anthropic import AnthropicDialect
from services.gateway.upstreams.openai import OpenAIDialect
from services.gateway.upstreams.sampling import FIELDS
from services.gateway.upstreams.usage import CHARS_PER_TOKEN, UsageCounter, prompt_text
from tests.helpers.service_harness import REPO_ROOT

SMOLLM2 = REPO_ROOT / "models" / "smollm2-135m-instruct"


def routes(target: dict) -> dict:
    return {"targets": [target], "models": {"m": target["name"]}}


def test_routes_file_kinds_and_their_fields(monkeypatch):
    monkeypatch.setenv("UP_KEY", "sk-1")
    spec = parse_routes(routes({"name": "up", "kind": "openai", "url": "http://h:8080/v1/", "model": "smol",
                                "token_env": "UP_KEY", "timeouts": {"connect_s": 2, "ttft_s": 1.5},
                                "seed_profile": {"ttft_p50_ms": 300, "ttft_p99_ms": 900, "tokens_per_second": 40},
                                "tls": {"verify": False}})).targets[0]
    assert (spec.kind, spec.address, spec.model, spec.token, spec.http) == ("openai", "http://h:8080/v1", "smol",
                                                                            "sk-1", True)
    assert (spec.timeouts.connect_s, spec.timeouts.ttft_s, spec.timeouts.total_s) == (2.0, 1.5, 0.0)
    assert spec.seed == SeedProfile(300.0, 900.0, 40.0) and spec.tls.verify is False
    assert not parse_routes(routes({"name": "e", "address": "h:1"})).targets[0].http


@pytest.mark.parametrize("target, message", [
    ({"name": "u", "kind": "vllm", "url": "http://h/v1", "model": "m"}, "kind must be one of"),
    ({"name": "u", "kind": "openai", "address": "h:1", "model": "m"}, "unknown fields ['address']"),
    ({"name": "u", "kind": "openai", "url": "h:8080", "model": "m"}, "url must be an http:// or https://"),
    ({"name": "u", "kind": "anthropic", "url": "https://h"}, "model must name the model"),
    ({"name": "u", "kind": "openai", "url": "http://h", "model": "m", "timeouts": {"ttft_s": -1}},
     "timeouts.ttft_s must be a number >= 0"),
    ({"name": "u", "kind": "openai", "url": "http://h", "model": "m",
      "seed_profile": {"ttft_p50_ms": 300, "ttft_p99_ms": 100, "tokens_per_second": 4}}, "must be >= ttft_p50_ms"),
    ({"name": "u", "kind": "openai", "url": "http://h", "model": "m", "seed_profile": {"ttft_p50_ms": 3}},
     "seed_profile lacks ['ttft_p99_ms', 'tokens_per_second']"),
    ({"name": "u", "kind": "openai", "url": "https://h", "model": "m", "tls": {"ca": "/nonexistent/ca.pem"}},
     "tls.ca: /nonexistent/ca.pem is not a file"),
    ({"name": "e", "address": "h:1", "tls": {"verify": False}}, "unknown fields ['verify']"),
])
def test_a_bad_upstream_entry_is_named(target, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_routes(routes(target))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_passive_profile_seed_until_measured_then_the_window():
    clock = Clock()
    profile = PassiveProfile(10.0, SeedProfile(200.0, 600.0, 50.0), clock)
    seeded = profile.view(inflight=2)
    assert seeded.has_latency and seeded.seeded and seeded.num_requests == 0
    assert (seeded.ttft_p50_ms, seeded.ttft_p99_ms, seeded.tpot_p50_ms, seeded.num_running) == (200.0, 600.0, 20.0, 2)
    for ttft, e2e in ((100.0, 1000.0), (300.0, 2100.0)):  # 10 tokens: TPOT 100 and 200 ms
        profile.observe(ttft, e2e, 10)
    measured = profile.view(inflight=0)
    assert not measured.seeded and measured.num_requests == 2
    assert measured.ttft_p50_ms == pytest.approx(200.0) and measured.tpot_p50_ms == pytest.approx(150.0)
    assert measured.ttft_p99_ms == pytest.approx(298.0)
    assert measured.tokens_per_second_per_stream == pytest.approx(7.5)  # median of 10 and 5 tokens/s
    clock.now += 11.0  # out of the window: the seed again
    assert profile.view(inflight=0).seeded
    assert not PassiveProfile(10.0, None, clock).view(0).has_latency


def chat_request(**stop) -> generation_pb2.GenerateRequest:
    message = generation_pb2.GenerateRequest(request_id="r1")
    message.chat.messages.add(role="system", content="Be brief.")
    message.chat.messages.add(role="user", content="Weather in Paris?")
    message.chat.messages.add(role="assistant", tool_calls=[common_pb2.ChatToolCall(
        id="c1", name="get_weather", arguments='{"city": "Paris"}')])
    message.chat.messages.add(role="tool", content="sunny", tool_call_id="c1")
    message.chat.tools_json = ('[{"type": "function", "function": {"name": "get_weather", "description": "d", '
                               '"parameters": {"type": "object"}}}]')
    message.sampling.temperature = 0.0
    message.stop.stop.append("\n\n")
    for key, value in stop.items():
        setattr(message.stop, key, value)
    return message


def test_openai_translation_of_a_conversation_with_calls():
    path, body = OpenAIDialect("smol").build(chat_request(max_tokens=7))
    assert path == "/chat/completions" and body["model"] == "smol" and body["stream"] is True
    assert body["messages"][2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert body["messages"][3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert body["tools"][0]["function"]["name"] == "get_weather"
    assert "tool_choice" not in body  # not said by the front end: the server's default
    assert (body["temperature"], body["max_tokens"], body["stop"]) == (0.0, 7, ["\n\n"])
    for choice in ("auto", "none"):  # said: llama.cpp's server makes calls only when told auto
        told = chat_request()
        told.chat.tool_choice = choice
        assert OpenAIDialect("smol").build(told)[1]["tool_choice"] == choice
        assert AnthropicDialect("claude").build(told)[1]["tool_choice"] == {"type": choice}
    text = generation_pb2.GenerateRequest(text="Once")
    text.sampling.seed = (1 << 64) - 5  # the front end's wrap of OpenAI's -5
    assert OpenAIDialect("smol").build(text) == ("/completions", {
        "model": "smol", "stream": True, "stream_options": {"include_usage": True}, "prompt": "Once", "seed": -5})


def test_openai_refuses_what_it_cannot_carry():
    message = chat_request()
    message.structured_output.regex = "[a-z]+"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        OpenAIDialect("smol").build(message)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in caught.value.details()


def test_openai_reader_counts_pieces_gathers_calls_and_takes_usage():
    reader = OpenAIDialect("smol").reader(chat_request())
    reader.feed("", {"choices": [{"delta": {"role": "assistant"}}]})
    reader.feed("", {"choices": [{"delta": {"content": "Hi"}}]})
    reader.feed("", {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "f",
                                                                                      "arguments": '{"a"'}}]}}]})
    reader.feed("", {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}]})
    assert reader.take() == ["Hi"] and reader.completion_tokens == 1
    reader.feed("", {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    assert reader.take() == ['<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>']
    assert reader.finish == common_pb2.FINISH_REASON_EOS
    reader.feed("", {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6}})
    assert (reader.prompt_tokens, reader.completion_tokens) == (9, 6)


def test_openai_reader_takes_a_call_whose_name_every_delta_repeats():
    # llama-cpp-python's server (0.3.36) streams a call so: the name in every delta, beside the
    # legacy function_call, arguments in pieces.
    reader = OpenAIDialect("smol").reader(chat_request())
    for piece in ("{", ' "', "city", '":', ' "', "Paris", '"', " }", ""):
        call = {"name": "get_weather", "arguments": piece}
        reader.feed("", {"choices": [{"index": 0, "finish_reason": None, "delta": {
            "role": None, "content": None, "function_call": call,
            "tool_calls": [{"index": 0, "id": "call__0_get_weather", "type": "function", "function": call}]}}]})
    reader.feed("", {"choices": [{"index": 0, "finish_reason": "tool_calls", "delta": {"tool_calls": None}}]})
    assert reader.take() == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>']


def test_anthropic_translation_and_reader():
    path, body = AnthropicDialect("claude").build(chat_request())
    assert path == "/v1/messages" and body["system"] == "Be brief." and body["max_tokens"] == 4096
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]}]
    assert body["tools"] == [{"name": "get_weather", "input_schema": {"type": "object"}, "description": "d"}]
    assert body["stop_sequences"] == ["\n\n"]
    seeded = chat_request()
    seeded.sampling.seed = 3
    with pytest.raises(grpc.aio.AioRpcError, match="seed cannot be sent to an anthropic upstream"):
        AnthropicDialect("claude").build(seeded)
    reader = AnthropicDialect("claude").reader(chat_request())
    for payload in ({"type": "message_start", "message": {"usage": {"input_tokens": 12}}},
                    {"type": "content_block_start", "content_block": {"type": "text", "text": ""}},
                    {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "It is"}},
                    {"type": "content_block_stop"},
                    {"type": "message_delta", "delta": {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"},
                     "usage": {"output_tokens": 3}},
                    {"type": "message_stop"}):
        reader.feed(payload["type"], payload)
    assert reader.take() == ["It is"] and reader.done
    assert (reader.prompt_tokens, reader.completion_tokens) == (12, 3)
    assert (reader.finish, reader.stop_reason) == (common_pb2.FINISH_REASON_STOP, "\n\n")


def every_field_set() -> generation_pb2.GenerateRequest:
    message = chat_request()
    s, stop = message.sampling, message.stop
    s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty = 0.5, 0.9, 40, 0.05, 1.1
    s.presence_penalty, s.frequency_penalty, s.seed = 0.2, 0.3, 7
    s.logit_bias[13] = -1.0
    s.logprobs, s.prompt_logprobs = 2, 1
    stop.max_tokens, stop.ignore_eos, stop.min_tokens, stop.include_stop_str_in_output = 9, True, 2, True
    stop.stop_token_ids.append(2)
    return message


def test_one_field_map_covers_every_sampling_and_stopping_field():
    """A field added to the proto without a line in the shared map would be dropped by both
    dialects without a word: the map must name each one."""
    message = generation_pb2.GenerateRequest()
    declared = {f.name for f in message.sampling.DESCRIPTOR.fields} | {f.name for f in message.stop.DESCRIPTOR.fields}
    assert {name for name, _ in FIELDS} == declared
    read = {name: get(every_field_set()) for name, get in FIELDS}
    assert all(value is not None for value in read.values()), read
    assert {name: get(generation_pb2.GenerateRequest()) for name, get in FIELDS} == dict.fromkeys(declared)


@pytest.mark.parametrize("dialect", [OpenAIDialect("m"), AnthropicDialect("m")], ids=["openai", "anthropic"])
def test_each_dialect_carries_its_fields_and_refuses_the_others_by_name(dialect):
    carried = dict(openai_dialect.SAMPLING if dialect.kind == "openai" else anthropic_dialect.SAMPLING)
    for name, _ in FIELDS:
        message = generation_pb2.GenerateRequest()
        message.CopyFrom(every_field_set())
        for other, _ in FIELDS:  # only ``name`` left set
            if other != name:
                (message.sampling if message.sampling.DESCRIPTOR.fields_by_name.get(other) else message.stop
                 ).ClearField(other)
        if name in carried:
            _, body = dialect.build(message)
            assert body[carried[name]] not in (None, 0, [], {}), (name, body)
        else:
            with pytest.raises(grpc.aio.AioRpcError, match=f"details = \"{name} cannot be sent to an {dialect.kind} upstream"):
                dialect.build(message)
    assert "logprobs" not in carried and "stop_sequences" == anthropic_dialect.SAMPLING["stop"]
    assert len(openai_dialect.SAMPLING) == len(FIELDS) - 2  # all but the per-token-id logprobs


def test_circuit_breaker_opens_probes_once_and_closes():
    from services.gateway.routing.breaker import CircuitBreaker

    clock = Clock()
    breaker = CircuitBreaker(failures=3, open_s=5.0, clock=clock)
    assert not breaker.failed() and not breaker.failed()
    breaker.succeeded()  # a success resets the count: failures must come in a row
    assert not breaker.failed() and not breaker.failed() and breaker.failed()
    assert breaker.state == "open" and not breaker.admits()
    clock.now += 4.9
    assert not breaker.admits()
    clock.now += 0.2
    assert breaker.admits() and breaker.state == "half_open"
    assert breaker.dispatched() and not breaker.admits() and not breaker.dispatched()  # one probe at a time
    assert breaker.failed() and breaker.state == "open" and breaker.opened == 2  # the probe failed: open again
    clock.now += 5.1
    assert breaker.admits() and breaker.dispatched()
    breaker.ended_without_verdict()  # the client went away: the next request probes
    assert breaker.admits() and breaker.dispatched()
    breaker.succeeded()
    assert breaker.state == "closed" and breaker.admits() and not breaker.dispatched()


def test_a_target_with_every_slot_taken_is_tried_after_the_others():
    from services.gateway.routing.target import TargetState, with_room_first

    serial, big = TargetState("serial", max_concurrency=1), TargetState("big")
    free = TargetState("two", max_concurrency=2)
    ranked = [serial, big, free]
    assert with_room_first(ranked) is ranked  # nothing open there: as ranked
    serial.inflight, free.inflight, big.inflight = 1, 1, 50
    assert with_room_first(ranked) == [big, free, serial]
    free.inflight = 2
    assert with_room_first(ranked) == [big, serial, free]
    assert parse_routes(routes({"name": "e", "address": "h:1", "max_concurrency": 1})).targets[0].max_concurrency == 1
    with pytest.raises(ValueError, match="max_concurrency must be an integer >= 0"):
        parse_routes(routes({"name": "e", "address": "h:1", "max_concurrency": -1}))


def test_usage_an_upstream_does_not_report_is_counted_with_the_tokenizer_or_estimated(tmp_path):
    message = chat_request()
    text = prompt_text(message)
    assert all(part in text for part in ("Be brief.", "Weather in Paris?", "get_weather", '{"city": "Paris"}',
                                         "sunny", '"description": "d"'))
    assert UsageCounter().prompt_tokens(message) == math.ceil(len(text) / CHARS_PER_TOKEN)
    tokenizer = Tokenizer.from_file(str(SMOLLM2 / "tokenizer.json"))
    counted = UsageCounter(str(SMOLLM2)).prompt_tokens(message)
    assert counted == len(tokenizer.encode(text, add_special_tokens=False).ids)
    assert counted != UsageCounter().prompt_tokens(message)  # the premise: the two ways differ here
    ids = generation_pb2.GenerateRequest()
    ids.token_ids.ids.extend([5, 6, 7])
    assert UsageCounter().prompt_tokens(ids) == 3
    reader = OpenAIDialect("m").reader(ids)
    reader.feed("", {"choices": [{"delta": {"content": "Hi"}}]})
    assert (reader.prompt_reported, reader.completion_reported, reader.completion_tokens) == (False, False, 1)
    reader.feed("", {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6}})
    assert (reader.prompt_reported, reader.completion_reported) == (True, True)


@pytest.mark.parametrize("tokenizer, message", [
    ("nowhere", "tokenizer: {base}/nowhere is neither a tokenizer.json nor a directory holding one"),
    (3, "tokenizer must be a path"),
])
def test_a_bad_upstream_tokenizer_is_named(tokenizer, message, tmp_path):
    path = tmp_path / "routes.json"
    path.write_text(json.dumps(routes({"name": "u", "kind": "openai", "url": "http://h/v1", "model": "m",
                                       "tokenizer": tokenizer})))
    with pytest.raises(ValueError, match=re.escape(message.format(base=tmp_path))):
        load_routes(str(path))


def test_the_front_end_says_each_tool_choice_and_the_constrained_forms_also_go_as_structured_output():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ask = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    said = {}
    for choice in (None, "auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}):
        body = ChatCompletionRequest.model_validate({**ask, "tools": [tool], "tool_choice": choice})
        said[json.dumps(choice)] = chat_template(body).chat.tool_choice
    assert list(said.values()) == ["auto", "auto", "none", "required", "function"]
    assert chat_template(ChatCompletionRequest.model_validate(ask)).chat.tool_choice == ""  # no tools


def test_a_named_tool_choice_is_the_upstreams_own_call_its_arguments_the_reply():
    message = chat_request()
    message.structured_output.json_schema = '{"type": "object"}'  # what the front end sets beside it
    message.chat.tool_choice, message.chat.tool_function = "function", "get_weather"
    _, body = OpenAIDialect("smol").build(message)
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert "response_format" not in body  # the call obeys the function's parameters itself
    reader = OpenAIDialect("smol").reader(message)
    for piece in ("", '{"city"', ': "Paris"}'):
        reader.feed("", {"choices": [{"delta": {"tool_calls": [
            {"index": 0, "function": {"name": "get_weather", "arguments": piece}}]}}]})
    reader.feed("", {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    assert reader.take() == ['{"city"', ': "Paris"}'] and reader.finish == common_pb2.FINISH_REASON_EOS


def test_a_required_tool_choice_is_the_upstreams_own_call_in_the_constrained_replys_shape():
    message = chat_request()
    message.structured_output.grammar = 'start: "{"'  # what the front end sets beside it: not sendable
    message.chat.tool_choice = "required"
    _, body = OpenAIDialect("smol").build(message)
    # one tool: as that tool named (servers that ignore "required" honour it)
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert "response_format" not in body
    two = json.loads(message.chat.tools_json) * 2
    two[1] = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    message.chat.tools_json = json.dumps(two)
    assert OpenAIDialect("smol").build(message)[1]["tool_choice"] == "required"
    reader = OpenAIDialect("smol").reader(message)
    reader.feed("", {"choices": [{"delta": {"content": "Sure: "}}]})  # no content beside a call
    for piece in ('{"city"', ': "Paris"}'):
        reader.feed("", {"choices": [{"delta": {"tool_calls": [
            {"index": 0, "function": {"name": "get_time", "arguments": piece}}]}}]})
    reader.feed("", {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    assert "".join(reader.take()) == '{"name": "get_time", "arguments": {"city": "Paris"}}'
    text_only = OpenAIDialect("smol").reader(message)
    text_only.feed("", {"choices": [{"delta": {"content": "Paris is sunny."}}]})
    with pytest.raises(grpc.aio.AioRpcError, match="answered text, not a tool call, to tool_choice required"):
        text_only.feed("", {"choices": [{"delta": {}, "finish_reason": "stop"}]})
    cut = OpenAIDialect("smol").reader(message)  # cut by max_tokens before the call began: empty, as an engine's
    cut.feed("", {"choices": [{"delta": {}, "finish_reason": "length"}]})
    assert cut.take() == [] and cut.finish == common_pb2.FINISH_REASON_LENGTH


def test_a_call_that_never_reached_its_target_is_told_from_one_that_died_there():
    """The evidence the dispatcher's grammar quarantine needs (dispatch.reached): a refused
    connection (grpc's words for it, an upstream's ConnectError) is not a death while admitting."""
    from services.gateway.dispatch import reached
    from services.gateway.upstreams.errors import rpc_error

    def grpc_error(details: str) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    assert not reached(grpc_error("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
                                  "Failed to connect to remote host: Connection refused"))
    assert reached(grpc_error("Stream removed (Socket closed)"))
    assert not reached(rpc_error(grpc.StatusCode.UNAVAILABLE, "upstream u cannot be reached", reached=False))
    assert reached(rpc_error(grpc.StatusCode.UNAVAILABLE, "upstream u broke off the stream"))
