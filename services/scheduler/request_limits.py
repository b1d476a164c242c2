"""How large a Generate request may be: checked on the protobuf message before anything in it is
copied, tokenized or queued.

Every repeated or variable-size field has a bound (its own limit, or the model's context), and
each is checked by counting in place (``len`` of a repeated field or a map): a request of 2.5
million empty chat messages or 8 million stop ids is refused in microseconds, where copying it
first took seconds and hundreds of megabytes. The errors name the field and the limit, as every
refusal does.

The same bounds give the largest valid request in bytes (``RequestLimits.message_bytes``): the
public server's message limit is no larger, so a body padded with unknown fields cannot make
one request hold more memory than the biggest request the model can serve.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.adapters import MAX_ADAPTER_NAME_CHARS, name_problem
from services.common.detokenize import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from services.common.errors import InvalidArgumentError
from services.common.pb.tokenmill.v1 import generation_pb2
from services.common.sampling_params import MAX_LOGIT_BIAS_ENTRIES
from services.scheduler.request.stop import MAX_STOP_TOKEN_IDS
from services.scheduler.structured.grammar_compiler import MAX_CHOICES

MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_FAIRNESS_KEY_CHARS = 256
CHARS_PER_TOKEN_BOUND = 32
"""With max_prompt_chars = 0, a text prompt may have this many characters per token of context:
far more than any tokenizer packs into a token (runs of spaces in code come closest), so a text
that cannot fit is refused before it costs the tokenizer anything."""
MAX_CHAT_MESSAGES = 1024
"""Turns in one conversation (the tokenizer's chat template has the same bound)."""
MAX_ROLE_CHARS = 64
"""Characters of one chat role ("system", "assistant", "tool" ...)."""
MAX_CHAT_TOOL_CALLS = 4096
"""Tool calls in one conversation's history (the tokenizer's chat template has the same bound)."""
UTF8_BYTES_PER_CHAR = 4
FIELD_FRAMING_BYTES = 16
"""Tag and length of one protobuf field or entry, rounded up."""
FIXED_FIELDS_BYTES = 4096
"""The scalar fields (sampling, stop flags, priority ...) with room to spare."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The size bounds of a Generate request for one model."""

    max_model_len: int
    max_prompt_chars: int = 0
    """Longest text prompt (chat: its roles, contents, names, tool calls and tools_json together);
    0 = CHARS_PER_TOKEN_BOUND characters per token of the context."""
    max_grammar_bytes: int = 0
    """Largest structured output (SchedulerLimits.max_grammar_bytes; checked by the compiler)."""

    @property
    def prompt_chars(self) -> int:
        return self.max_prompt_chars or CHARS_PER_TOKEN_BOUND * self.max_model_len

    def message_bytes(self) -> int:
        """The largest valid request, serialized: the biggest prompt (text, token ids or chat),
        plus every bounded field at its bound."""
        text = UTF8_BYTES_PER_CHAR * self.prompt_chars + FIELD_FRAMING_BYTES
        token_ids = 5 * self.max_model_len + FIELD_FRAMING_BYTES  # a non-negative int32 varint: <= 5 bytes
        # A turn's entry and its role, content, name and tool_call_id; a call's entry and its
        # id, name and arguments: each under two framings.
        chat = text + (MAX_CHAT_MESSAGES + MAX_CHAT_TOOL_CALLS) * 2 * FIELD_FRAMING_BYTES
        stop = (MAX_STOP_STRINGS * (UTF8_BYTES_PER_CHAR * MAX_STOP_STRING_CHARS + FIELD_FRAMING_BYTES)
                + MAX_STOP_TOKEN_IDS * FIELD_FRAMING_BYTES)
        logit_bias = MAX_LOGIT_BIAS_ENTRIES * FIELD_FRAMING_BYTES
        request_id = (UTF8_BYTES_PER_CHAR * (MAX_REQUEST_ID_CHARS + MAX_CACHE_SALT_CHARS + MAX_FAIRNESS_KEY_CHARS
                                            + MAX_ADAPTER_NAME_CHARS) + 4 * FIELD_FRAMING_BYTES)
        structured = self.max_grammar_bytes + MAX_CHOICES * FIELD_FRAMING_BYTES if self.max_grammar_bytes else 0
        return max(text, token_ids, chat) + stop + logit_bias + request_id + structured + FIXED_FIELDS_BYTES


def check_sizes(request: generation_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Raise InvalidArgumentError naming the first field over its bound; copies nothing."""
    stop = request.stop
    _at_most("stop.stop_token_ids", len(stop.stop_token_ids), MAX_STOP_TOKEN_IDS, "MAX_STOP_TOKEN_IDS")
    _at_most("stop.stop", len(stop.stop), MAX_STOP_STRINGS, "MAX_STOP_STRINGS")
    _at_most("sampling.logit_bias", len(request.sampling.logit_bias), MAX_LOGIT_BIAS_ENTRIES,
             "MAX_LOGIT_BIAS_ENTRIES")
    _at_most("cache_salt", len(request.cache_salt), MAX_CACHE_SALT_CHARS, "MAX_CACHE_SALT_CHARS", unit="characters")
    _at_most("fairness_key", len(request.fairness_key), MAX_FAIRNESS_KEY_CHARS, "MAX_FAIRNESS_KEY_CHARS",
             unit="characters")
    _at_most("adapter", len(request.adapter), MAX_ADAPTER_NAME_CHARS, "MAX_ADAPTER_NAME_CHARS", unit="characters")
    if request.adapter and (problem := name_problem(request.adapter)):
        raise InvalidArgumentError(f"adapter: {problem}")  # no name any load could have given: not NOT_FOUND
    kind = request.WhichOneof("prompt")
    if kind == "text":
        # len() of the field copies the text out of the message; the message limit bounds it.
        _at_most("prompt text", len(request.text), limits.prompt_chars, "max_prompt_chars", unit="characters")
    elif kind == "chat":
        _check_chat(request.chat, limits)


def _check_chat(chat: generation_pb2.ChatMessages, limits: RequestLimits) -> None:
    messages = chat.messages
    _at_most("prompt chat", len(messages), MAX_CHAT_MESSAGES, "MAX_CHAT_MESSAGES", unit="messages")
    # Measuring a role or a content copies it out of the message: at most MAX_CHAT_MESSAGES of
    # them, and no more text than the message limit (message_bytes) let in.
    budget = limits.prompt_chars
    calls = sum(len(message.tool_calls) for message in messages)
    _at_most("prompt chat", calls, MAX_CHAT_TOOL_CALLS, "MAX_CHAT_TOOL_CALLS", unit="tool calls")
    total = 0
    for index, message in enumerate(messages):
        role = len(message.role)
        if role > MAX_ROLE_CHARS:
            raise InvalidArgumentError(f"prompt chat messages[{index}].role has {role} characters; the limit "
                                       f"MAX_ROLE_CHARS is {MAX_ROLE_CHARS}")
        total += role + len(message.content) + len(message.tool_call_id) + len(message.name)
        for call in message.tool_calls:
            total += len(call.id) + len(call.name) + len(call.arguments)
    total += len(chat.tools_json)
    _at_most("prompt chat", total, budget, "max_prompt_chars",
             unit="characters of roles, content, names, tool calls and tools_json")


def _at_most(field: str, count: int, limit: int, name: str, unit: str = "entries") -> None:
    if count > limit:
        raise InvalidArgumentError(f"{field} has {count} {unit}; the limit {name} is {limit}")
