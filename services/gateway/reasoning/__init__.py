"""Reasoning read out of a model's reply: ``<think>...</think>`` goes to ``reasoning_content``.

One parser per format, as for tool calls (services/gateway/tool_calls): ``deepseek_r1`` (the
chat template opens ``<think>`` itself, so the reply starts inside the section) and ``qwen3``
(the reply is reasoning only when it opens ``<think>`` itself). ``PARSERS`` names them, as the
settings do (``--reasoning-parser``, a route's ``reasoning_parser``). The chat handler runs the
reasoning parser first and hands only the content on to the tool-call reader, so a call written
while thinking is never a call, and reasoning never reaches ``content``.
"""

from __future__ import annotations

from collections.abc import Callable

from services.gateway.reasoning.think import ThinkParser

PARSERS: dict[str, Callable[[], ThinkParser]] = {
    "deepseek_r1": lambda: ThinkParser(starts_inside=True),
    "qwen3": lambda: ThinkParser(starts_inside=False),
}
PARSER_SETTINGS = ("none", *PARSERS)
"""What the settings accept: ``none`` = replies are content alone."""


def parser_name(route_setting: str, gateway_setting: str) -> str | None:
    """The format to read a reply's reasoning in (the route's setting over the gateway's); None:
    the reply is content."""
    setting = route_setting or gateway_setting
    return setting if setting in PARSERS else None
