"""``tool_choice: auto``: which parser reads tool calls out of each choice's reply.

A request with tools and ``tool_choice`` auto (OpenAI's default when tools are given) is not
constrained: the model writes calls, if any, in the syntax its chat template taught it, and a
parser reads them back (services/gateway/tool_calls). Which one: the route's
``tool_call_parser`` in the routes file, else the gateway's ``--tool-call-parser``; ``auto``
there (the default) takes the format the serving engine reports (``ModelInfo.tool_call_format``,
read from its template's markers), so each choice is read in the syntax of the engine that wrote
it. ``none``, or ``auto`` where the template defines no format we know (SmolLM2's), leaves the
reply text. An engine with tenants refuses the gateway's own polls when the routes file gives the
target no ``token_env``: its format is then asked once with the caller's own token (the one its
Generate carries), so ``auto`` still reads that engine's syntax instead of silently none. A reply with a ``response_format`` other than text is JSON, never read for calls.

``parallel_tool_calls: false``: the reader stops at the first whole call, and the chat handler
ends that choice's engine stream there (finish_reason "tool_calls"): what the model would write
after it is never generated, rather than generated and dropped.
"""

from __future__ import annotations

import grpc
import structlog

from services.common.pb.tokenmill.v1 import generation_pb2
from services.gateway.dispatch import Dispatcher
from services.gateway.http.protocol import ChatCompletionRequest
from services.gateway.routing.build import Route
from services.gateway.tool_calls import PARSERS
from services.gateway.tool_calls.reader import ReplyReader


_log = structlog.get_logger("tokenmill.gateway.auto_tools")
MODEL_INFO_TIMEOUT_S = 5.0


def reads_calls(body: ChatCompletionRequest) -> bool:
    """Whether this request's replies are read for calls (tools, auto, no JSON constraint)."""
    text_format = body.response_format is None or body.response_format.type == "text"
    return bool(body.tools) and body.tool_choice in (None, "auto") and text_format


def parser_name(route: Route, gateway_setting: str, engine_format: str) -> str | None:
    """The format to read a reply in; None: it is text."""
    setting = route.tool_call_parser or gateway_setting
    if setting == "auto":
        setting = engine_format
    return setting if setting in PARSERS else None


async def learn_formats(body: ChatCompletionRequest, dispatcher: Dispatcher, request_ids: list[str],
                        metadata: tuple[tuple[str, str], ...] | None) -> None:
    """Fill in the model info of each engine serving a choice that the gateway's polls could not
    read, asking with the caller's credentials (``metadata``; None: the gateway's own token). The
    info is the engine's, not the tenant's: kept on the target for every later caller."""
    if not reads_calls(body):
        return
    for target in dict.fromkeys(dispatcher.live.get(rid) for rid in request_ids):
        if target is None or target.model_info is not None or target.stub is None:
            continue
        try:
            target.model_info = await target.stub.GetModelInfo(
                generation_pb2.GetModelInfoRequest(), timeout=MODEL_INFO_TIMEOUT_S,
                metadata=target.own_metadata if metadata is None else metadata)
        except grpc.aio.AioRpcError as err:
            _log.info("tool_call_format_unknown", target=target.spec.name, code=err.code().name,
                      consequence="replies read as text")


def readers(body: ChatCompletionRequest, route: Route, gateway_setting: str, dispatcher: Dispatcher,
            request_ids: list[str], call_id_prefix: str) -> list[ReplyReader | None]:
    """One reader per choice (None where its reply is text), once the calls are started: the
    target serving each one is known then (it cannot change after the first event)."""
    if not reads_calls(body):
        return [None] * len(request_ids)
    names = frozenset(t.function.name for t in body.tools)
    max_calls = 1 if body.parallel_tool_calls is False else None
    out: list[ReplyReader | None] = []
    for index, request_id in enumerate(request_ids):
        target = dispatcher.live.get(request_id)
        info = target.model_info if target is not None else None
        name = parser_name(route, gateway_setting, info.tool_call_format if info is not None else "")
        out.append(ReplyReader(PARSERS[name](names, max_calls), f"{call_id_prefix}_{index}")
                   if name is not None else None)
    return out
