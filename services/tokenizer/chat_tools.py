"""The chat template's tools: its ``tools`` variable read from JSON, and the tool-call syntax the
template defines, read from its markers.

transformers' apply_chat_template hands a template the request's tools as ``tools`` (a list of
OpenAI tool objects, ``{"type": "function", "function": {...}}``); templates with a tool format
write them into the system turn and tell the model how to call one. The same list reaches our
templates from ``RenderChatRequest.tools_json``; a template that does not use ``tools`` renders
exactly as without them.

Which syntax a template teaches is a fact of the template, so it is read here, where the
template is, and reported in TokenizerInfo (and the engine's ModelInfo): a client that parses
calls out of replies (the gateway) needs it. The markers:

- ``hermes``: the template writes ``<tool_call>`` (Hermes 2 Pro, Qwen2.5, Qwen3): calls are
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, one or several, after text or not;
- ``mistral``: the template writes ``[TOOL_CALLS]`` (Mistral 7B v0.3, Mistral Nemo/Small):
  calls are ``[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]``;
- ``llama3_json``: Llama 3.1-3.3's instruction to answer with ``{"name": function name,
  "parameters": ...}``, or its ``<|python_tag|>``: the whole reply is one such object
  (or several separated by ``;``).

The first that matches wins, in that order; none is "".
"""

from __future__ import annotations

import json
from typing import Any

from services.common.errors import InvalidArgumentError

TOOL_CALL_FORMATS = ("hermes", "mistral", "llama3_json")

_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("llama3_json", ('"parameters": dictionary of argument name', "<|python_tag|>")),
)


def tool_call_format(template_source: str | None) -> str:
    """The tool-call syntax a chat template defines (see the module docstring); "" for none."""
    if not template_source:
        return ""
    for name, markers in _MARKERS:
        if any(marker in template_source for marker in markers):
            return name
    return ""


def parse_tools_json(text: str, limit: int) -> list[dict[str, Any]] | None:
    """The ``tools`` variable of ``tools_json``: None when empty, else a list of objects.

    ``limit``: the most characters it may have (what is left of the conversation's budget)."""
    if not text:
        return None
    if len(text) > limit:
        raise InvalidArgumentError(f"tools_json has {len(text)} characters; with the messages it passes the limit "
                                   f"MAX_TOTAL_CONTENT_CHARS")
    try:
        tools = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgumentError(f"tools_json is not JSON: {exc}") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InvalidArgumentError("tools_json must be a JSON array of objects (OpenAI tool objects)")
    return tools
