"""Tool calls read out of a model's free text, in the syntax its chat template teaches.

One module per format (``hermes``, ``llama3_json``, ``mistral``), each a streaming parser
(events.py) on the shared buffer and loop of state_machine.py; reader.py turns their events into OpenAI's deltas and messages; json_call.py reads
the JSON of one call as it arrives. ``PARSERS`` names them, as the settings
(``--tool-call-parser``, a route's ``tool_call_parser``) and the engine's
``ModelInfo.tool_call_format`` do. Each takes the functions the request offers and the most
calls to read (None: all; 1 for ``parallel_tool_calls: false``). A reply constrained to one
call (``tool_choice`` required or named) is read by one more parser, constrained.py, behind the
same interface, so every chat reply that can make calls goes through one ReplyReader.
"""

from __future__ import annotations

from collections.abc import Callable

from services.gateway.tool_calls.events import ToolCallParser
from services.gateway.tool_calls.hermes import HermesParser
from services.gateway.tool_calls.llama3_json import Llama3JsonParser
from services.gateway.tool_calls.mistral import MistralParser

PARSERS: dict[str, Callable[[frozenset[str] | None, int | None], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
PARSER_SETTINGS = ("auto", "none", *PARSERS)
"""What the settings accept: ``auto`` = the format the serving engine's template defines,
``none`` = replies are text."""
