"""Hugging Face chat templates, rendered in Jinja2's immutable sandbox with size limits.

A chat template ships with the model (tokenizer_config.json or chat_template.jinja), so it is
code from a download, and the messages it loops over come from clients. The sandbox blocks
attribute access to internals (``__class__``, ``__globals__``) and mutation of the arguments;
the limits bound the work one request can cause. Each limit is a named constant that its error
message names.

The environment matches transformers' apply_chat_template: trim_blocks and lstrip_blocks,
the loopcontrols extension, ``raise_exception(message)``, ``strftime_now(format)`` and a
``tojson`` filter that keeps non-ASCII text and does not HTML-escape.

The rendered text already contains the template's special tokens (BOS included, for templates
that write ``{{ bos_token }}``): encode it with add_special_tokens=False.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.tokenizer.text_tokenizer import TextTokenizer

MAX_TEMPLATE_CHARS = 131_072
"""Template source size; the largest public templates (tool calling included) are ~20 KB."""
MAX_MESSAGES = 1024
MAX_TOTAL_CONTENT_CHARS = 2_000_000
"""Sum of the text content of all messages (about 500K tokens of English)."""
MAX_RENDERED_CHARS = 4_000_000
"""Rendering stops as soon as the output passes this size, so a looping template cannot fill memory."""
MAX_POWER_BITS = 4096
"""Largest integer power a template may compute."""
MAX_ROLE_CHARS = 64
"""Characters of one message's role ("system", "assistant", "tool" ...)."""
MAX_TOOL_CALLS = 4096
"""Tool calls in one conversation's assistant turns together: each becomes a few dicts, so a
history of a million empty calls (2 bytes each on the wire) is refused by its count."""


class ChatTemplateError(ValueError):
    """The template is missing, invalid, refused by the sandbox, or a limit was exceeded."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Refuse unsafe attributes outright, and products too large to make.

    Jinja's sandbox turns ``x.__class__`` into an undefined value that prints as "", so a probing
    template would render quietly; raising makes the attempt visible to the client and the logs.
    A product ``'x' * 10**9`` or a power ``10**10**8`` runs in C, where the rendering deadline
    (services/tokenizer/deadline_worker.py) cannot interrupt it, so their sizes are checked first.
    """

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and isinstance(count, int) \
                        and len(sequence) * count > MAX_RENDERED_CHARS:
                    raise ChatTemplateError(f"chat template: a product of {len(sequence)} x {count} items passes "
                                            f"the limit MAX_RENDERED_CHARS ({MAX_RENDERED_CHARS})")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) \
                and right > 0 and max(abs(left), 2).bit_length() * right > MAX_POWER_BITS:
            raise ChatTemplateError(f"chat template: {left} ** {right} passes the limit MAX_POWER_BITS "
                                    f"({MAX_POWER_BITS} bits)")
        return super().call_binop(context, operator, left, right)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _content_chars(content: Any, index: int) -> int:
    """Characters of text in a message's content: a string, None, or a list of parts."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if isinstance(content, Sequence):
        total = 0
        for part in content:
            if not isinstance(part, Mapping):
                raise ChatTemplateError(f"messages[{index}].content parts must be objects, got {type(part).__name__}")
            text = part.get("text")
            total += len(text) if isinstance(text, str) else 0
        return total
    raise ChatTemplateError(f"messages[{index}].content must be a string, a list of parts or null")


def _tool_chars(message: Mapping[str, Any]) -> int:
    """Characters of a turn's name and tool_call_id and its calls' ids and names (parsed
    arguments are bounded by the request's serialized size, which the services check first)."""
    total = sum(len(value) for key in ("name", "tool_call_id") if isinstance(value := message.get(key), str))
    for call in _calls(message):
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        call_id = call.get("id") if isinstance(call, Mapping) else None
        total += (len(name) if isinstance(name, str) else 0) + (len(call_id) if isinstance(call_id, str) else 0)
    return total


def _calls(message: Mapping[str, Any]) -> Sequence[Any]:
    calls = message.get("tool_calls")
    return calls if isinstance(calls, Sequence) else ()


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> int:
    """Check the message and tool-call counts, roles and total size (roles, contents, names,
    tool-call ids and names) against the limits; the characters they hold."""
    if len(messages) > MAX_MESSAGES:
        raise ChatTemplateError(f"messages has {len(messages)} entries; the limit MAX_MESSAGES is {MAX_MESSAGES}")
    check_tool_calls(sum(len(_calls(message)) for message in messages if isinstance(message, Mapping)))
    total = 0
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{index}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{index}].role must be a non-empty string")
        if len(role) > MAX_ROLE_CHARS:
            raise ChatTemplateError(f"messages[{index}].role has {len(role)} characters; the limit MAX_ROLE_CHARS is "
                                    f"{MAX_ROLE_CHARS}")
        total += len(role) + _content_chars(message.get("content"), index) + _tool_chars(message)
        if total > MAX_TOTAL_CONTENT_CHARS:
            raise ChatTemplateError(
                f"messages roles and content exceed {MAX_TOTAL_CONTENT_CHARS} characters (the limit "
                "MAX_TOTAL_CONTENT_CHARS)"
            )
    return total


def check_tool_calls(count: int) -> None:
    if count > MAX_TOOL_CALLS:
        raise ChatTemplateError(f"messages hold {count} tool calls; the limit MAX_TOOL_CALLS is {MAX_TOOL_CALLS}")


class ChatTemplate:
    """A compiled chat template bound to the model's bos/eos tokens; compile once, render often."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(
                f"chat template has {len(source)} characters; the limit MAX_TEMPLATE_CHARS is {MAX_TEMPLATE_CHARS}"
            )
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from exc
        # Templates write "{{ bos_token + ... }}"; an undefined token would fail the addition.
        self._bos_token = bos_token or ""
        self._eos_token = eos_token or ""

    @classmethod
    def from_tokenizer(cls, tokenizer: TextTokenizer) -> ChatTemplate:
        """The model's template; a clear error when the model ships none."""
        if tokenizer.chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template (none in tokenizer_config.json, chat_template.jinja or "
                "chat_template.json): send a plain prompt instead of chat messages"
            )
        return cls(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        extra_context: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages`; extra_context adds variables (tools, enable_thinking...)."""
        validate_messages(messages)
        context = dict(extra_context or {})
        context.update(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_token,
            eos_token=self._eos_token,
        )
        pieces: list[str] = []
        size = 0
        try:
            for piece in self._template.generate(**context):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise ChatTemplateError(
                        f"rendered chat prompt exceeds {MAX_RENDERED_CHARS} characters (the limit MAX_RENDERED_CHARS)"
                    )
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except Exception as exc:
            # Template code is arbitrary: SecurityError and UndefinedError, but also a TypeError
            # when a client's message shape is not what the template expects. All are the
            # request's fault, not the server's.
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return "".join(pieces)


def render_chat(
    tokenizer: TextTokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    extra_context: Mapping[str, Any] | None = None,
) -> str:
    """One-shot convenience: compile the tokenizer's template and render (services cache a ChatTemplate)."""
    return ChatTemplate.from_tokenizer(tokenizer).render(messages, add_generation_prompt, extra_context)
