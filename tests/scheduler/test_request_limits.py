"""A Generate request's sizes, checked on the message before anything in it is copied
(services/scheduler/request_limits.py): each refusal names the field and the limit, costs no
copy of the oversized field (traced allocations stay under a few KiB), and the largest valid
request fits the message limit derived from it."""

from __future__ import annotations

import tracemalloc

import pytest

from services.common.errors import InvalidArgumentError
from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2
from services.scheduler.request_limits import (MAX_CHAT_MESSAGES, MAX_CHAT_TOOL_CALLS, MAX_ROLE_CHARS, RequestLimits,
                                               check_sizes)

LIMITS = RequestLimits(max_model_len=512)


def refused(request: generation_pb2.GenerateRequest, limits: RequestLimits = LIMITS) -> tuple[str, int]:
    """The refusal's message and the most memory it allocated."""
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgumentError) as error:
            check_sizes(request, limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return str(error.value), peak


def test_millions_of_chat_messages_are_refused_by_their_count():
    request = generation_pb2.GenerateRequest()
    for _ in range(2_500_000):
        request.chat.messages.add(role="u")
    message, peak = refused(request)
    assert message == f"prompt chat has 2500000 messages; the limit MAX_CHAT_MESSAGES is {MAX_CHAT_MESSAGES}"
    assert peak < 16 << 10


def test_millions_of_tool_calls_are_refused_by_their_count():
    request = generation_pb2.GenerateRequest()
    request.chat.messages.add(role="assistant")
    for _ in range(2_000_000):
        request.chat.messages[0].tool_calls.add()
    message, peak = refused(request)
    assert message == f"prompt chat has 2000000 tool calls; the limit MAX_CHAT_TOOL_CALLS is {MAX_CHAT_TOOL_CALLS}"
    assert peak < 16 << 10


TOO_LONG_CHAT = ("prompt chat has 16388 characters of roles, content, names, tool calls and tools_json; the limit "
                 "max_prompt_chars is 16384")


def test_roles_count_toward_the_conversation_and_have_a_bound_of_their_own():
    # A role of millions of characters never gets this far: the message limit derived from
    # these bounds refuses its body before it is parsed (tests/stack/test_hostile.py).
    request = generation_pb2.GenerateRequest()
    request.chat.messages.add(role="r" * (MAX_ROLE_CHARS + 1), content="hi")
    assert refused(request)[0] == (f"prompt chat messages[0].role has {MAX_ROLE_CHARS + 1} characters; the limit "
                                   f"MAX_ROLE_CHARS is {MAX_ROLE_CHARS}")
    request = generation_pb2.GenerateRequest()
    for _ in range(2):
        request.chat.messages.add(role="user", content="x" * 8190)  # 2 x 8194 = 16388 characters in all
    assert refused(request)[0] == TOO_LONG_CHAT
    request = generation_pb2.GenerateRequest()
    request.chat.messages.add(role="user", content="x" * 8190)
    request.chat.tools_json = "[" + " " * 8192 + "]"  # the tools count too: 8194 + 8194
    assert refused(request)[0] == TOO_LONG_CHAT
    request = generation_pb2.GenerateRequest()
    request.chat.messages.add(role="user", content="x" * 8190)
    # An assistant's calls and a tool turn's id count too: 8194 + (9 + 2 + 1 + 8176) + (4 + 2)
    request.chat.messages.add(role="assistant", tool_calls=[
        common_pb2.ChatToolCall(id="c1", name="f", arguments="[" + " " * 8174 + "]")])
    request.chat.messages.add(role="tool", tool_call_id="c1")
    assert refused(request)[0] == TOO_LONG_CHAT
    request = generation_pb2.GenerateRequest()
    request.chat.messages.add(role="user", content="x" * 8190)
    request.chat.messages.add(role="user", name="n" * 8190)  # a turn's name counts too: 8194 + 8194
    assert refused(request)[0] == TOO_LONG_CHAT


@pytest.mark.parametrize(("fill", "message"), [
    (lambda r: r.stop.stop_token_ids.extend(range(1000, 3_001_000)),
     "stop.stop_token_ids has 3000000 entries; the limit MAX_STOP_TOKEN_IDS is 64"),
    (lambda r: r.stop.stop.extend(["x"] * 100_000), "stop.stop has 100000 entries; the limit MAX_STOP_STRINGS is 16"),
    (lambda r: r.sampling.logit_bias.update({i: 1.0 for i in range(5000)}),
     "sampling.logit_bias has 5000 entries; the limit MAX_LOGIT_BIAS_ENTRIES is 1024"),
])
def test_repeated_fields_are_counted_in_place(fill, message):
    request = generation_pb2.GenerateRequest(text="Once")
    fill(request)
    got, peak = refused(request)
    assert got == message and peak < 16 << 10


def test_the_text_bound_follows_the_context_or_max_prompt_chars():
    assert refused(generation_pb2.GenerateRequest(text="x" * 16385))[0] == (
        "prompt text has 16385 characters; the limit max_prompt_chars is 16384")
    check_sizes(generation_pb2.GenerateRequest(text="x" * 16384), LIMITS)
    assert refused(generation_pb2.GenerateRequest(text="x" * 101), RequestLimits(512, max_prompt_chars=100))[0] == (
        "prompt text has 101 characters; the limit max_prompt_chars is 100")


def test_a_cache_salt_and_a_fairness_key_have_a_bound():
    assert refused(generation_pb2.GenerateRequest(text="x", cache_salt="s" * 257))[0] == (
        "cache_salt has 257 characters; the limit MAX_CACHE_SALT_CHARS is 256")
    check_sizes(generation_pb2.GenerateRequest(text="x", cache_salt="s" * 256), LIMITS)
    assert refused(generation_pb2.GenerateRequest(text="x", fairness_key="k" * 257))[0] == (
        "fairness_key has 257 characters; the limit MAX_FAIRNESS_KEY_CHARS is 256")
    check_sizes(generation_pb2.GenerateRequest(text="x", fairness_key="k" * 256), LIMITS)


def test_the_largest_valid_request_fits_the_derived_message_limit():
    limits = RequestLimits(max_model_len=512)
    biggest = []
    for kind in ("text", "token_ids", "chat", "chat_calls"):
        request = generation_pb2.GenerateRequest(request_id="\U0001F600" * 256, cache_salt="\U0001F600" * 256,
                                                 fairness_key="\U0001F600" * 256)
        if kind == "text":
            request.text = "\U0001F600" * limits.prompt_chars  # 4 bytes of UTF-8 each
        elif kind == "token_ids":
            request.token_ids.ids.extend([2**31 - 1] * (limits.max_model_len - 1))
        elif kind == "chat":
            per = limits.prompt_chars // MAX_CHAT_MESSAGES
            for _ in range(MAX_CHAT_MESSAGES):
                request.chat.messages.add(role="\U0001F600" * 4, content="\U0001F600" * (per - 4))
        else:
            # Every turn with a name, a tool_call_id and its share of the calls, one-character fields.
            per_turn = MAX_CHAT_TOOL_CALLS // MAX_CHAT_MESSAGES
            per = limits.prompt_chars // MAX_CHAT_MESSAGES - 4 - 3 * per_turn
            assert per >= 0
            for _ in range(MAX_CHAT_MESSAGES):
                request.chat.messages.add(role="\U0001F600" * 2, name="\U0001F600", tool_call_id="\U0001F600",
                                          content="\U0001F600" * per, tool_calls=[
                                              common_pb2.ChatToolCall(id="\U0001F600", name="\U0001F600",
                                                                      arguments="\U0001F600")] * per_turn)
        request.stop.stop.extend(["\U0001F600" * 256] * 16)
        request.stop.stop_token_ids.extend([2**31 - 1] * 64)
        request.sampling.logit_bias.update({2**31 - 1 - i: -100.0 for i in range(1024)})
        request.sampling.temperature = 0.5
        request.stop.max_tokens = 2**31 - 1
        check_sizes(request, limits)
        biggest.append(request.ByteSize())
    assert max(biggest) <= limits.message_bytes() < 2 * max(biggest)
