"""Which parser reads a tool_choice auto reply: the route's setting, else the gateway's, with
``auto`` taking the serving engine's template format; and which requests are read at all."""

from __future__ import annotations

import pytest

from services.gateway.http.auto_tools import parser_name, reads_calls
from services.gateway.http.protocol import ChatCompletionRequest
from services.gateway.routing.build import Route

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def route(setting: str) -> Route:
    return Route("m", None, None, False, 16, frozenset(), "", setting)


@pytest.mark.parametrize(("route_setting", "gateway_setting", "engine_format", "expected"), [
    ("", "auto", "hermes", "hermes"),          # the engine's template decides
    ("", "auto", "", None),                    # a template with no known format: text
    ("", "none", "hermes", None),              # the gateway turns reading off
    ("", "llama3_json", "hermes", "llama3_json"),
    ("mistral", "none", "", "mistral"),        # the route wins over the gateway
    ("auto", "none", "llama3_json", "llama3_json"),
    ("none", "hermes", "hermes", None),
    ("", "auto", "some_future_format", None),  # a format this gateway does not know: text
])
def test_the_route_then_the_gateway_then_the_engine_choose(route_setting, gateway_setting, engine_format, expected):
    assert parser_name(route(route_setting), gateway_setting, engine_format) == expected


@pytest.mark.parametrize(("fields", "read"), [
    ({"tools": [TOOL]}, True),                                        # auto is the default with tools
    ({"tools": [TOOL], "tool_choice": "auto"}, True),
    ({"tools": [TOOL], "tool_choice": "none"}, False),
    ({"tools": [TOOL], "tool_choice": "required"}, False),            # constrained: structured.py reads it
    ({"tools": [TOOL], "response_format": {"type": "json_object"}}, False),
    ({"tools": [TOOL], "response_format": {"type": "text"}}, True),
    ({}, False),
])
def test_which_requests_are_read_for_calls(fields, read):
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)
    assert reads_calls(body) is read
