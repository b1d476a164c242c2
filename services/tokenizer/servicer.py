"""The Tokenizer gRPC servicer: tokenizer.proto <-> TextService and DetokenizerPool.

Unary calls (Encode, Decode) on long inputs run in a worker thread, so one megabyte prompt does
not stall the Detokenize streams that share this event loop; short inputs run inline, where the
thread hop would cost more than the work. RenderChat always runs off the loop, under
``--chat-template-timeout-s`` (deadline_worker.py): the template is code shipped with the
model, and its cost is not the size of its input. Its message count and size are checked on
the request before a dict is built for any message.

Detokenize is one long-lived stream per scheduler with a DetokenizerPool of its own. Each
request message carries a whole step and gets exactly one response:

1. new_streams are opened. A stream with prompt_token_ids decodes its output as the prompt's
   continuation ("The cat" then "▁sat" gives " sat"), as the in-process engine does.
2. the appended tokens of each of stream_ids are decoded into its text delta. Deltas never
   end inside a UTF-8 character; together they are the stream's full text.
3. closed_stream_ids are forgotten. A stream closed in the message that carries its last
   tokens gets its held-back text (a character whose last byte token came this step, an
   unfinished byte run) flushed into that delta. A stream closed without tokens in the
   message (aborted, or stopped by a stop string on earlier text) is dropped as it is;
   unknown ids are ignored, since finish and abort may both report one.

A malformed message (stream ids, counts and tokens that do not add up) ends the call with
INVALID_ARGUMENT naming the field. A bad item of one stream (an id outside the vocabulary, a
stream opened twice or not open, bad stop strings) fails that stream alone: it is named in
failed_stream_ids and dropped, and the call goes on serving the scheduler's other requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc
import structlog

from services.common.codec.detokenize_codec import batch_from_proto, result_to_proto
from services.common.stream_session import logged_stream
from services.common.pb.tokenmill.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.errors import InvalidArgumentError
from services.tokenizer.chat_messages import messages_from_proto
from services.tokenizer.chat_template import MAX_MESSAGES, MAX_TOTAL_CONTENT_CHARS, check_tool_calls
from services.tokenizer.deadline_worker import DeadlineWorker
from services.tokenizer.detokenizer import DetokenizerPool
from services.tokenizer.text_service import TextService

INLINE_WORK_LIMIT = 16_384
"""Characters (Encode) or ids (Decode) handled on the event loop; more go to a thread."""
MESSAGE_FRAMING_BYTES = 32
"""Tags and lengths of one ChatMessage in a RenderChatRequest, rounded up."""

_log = structlog.get_logger("tokenmill.tokenizer")

T = TypeVar("T")


async def _run(size: int, work: Callable[[], T]) -> T:
    if size <= INLINE_WORK_LIMIT:
        return work()
    return await asyncio.to_thread(work)


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, service: TextService, chat_template_timeout_s: float = 2.0) -> None:
        self._service = service
        self._renderer = DeadlineWorker("chat-template", chat_template_timeout_s)
        facts = service.facts
        self._info = tokenizer_pb2.TokenizerInfo(
            tokenizer_path=facts.tokenizer_path,
            vocab_size=facts.vocab_size,
            eos_token_ids=facts.eos_token_ids,
            has_chat_template=facts.has_chat_template,
            tool_call_format=facts.tool_call_format,
        )
        if facts.bos_token_id is not None:
            self._info.bos_token_id = facts.bos_token_id
        if facts.pad_token_id is not None:
            self._info.pad_token_id = facts.pad_token_id
        self._next_stream_number = 0

    async def Encode(
        self, request: tokenizer_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.EncodeResponse:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        started = time.perf_counter()
        ids = await _run(len(request.text), lambda: self._service.encode(request.text, add_special))
        _log.debug("encoded", chars=len(request.text), tokens=len(ids), ms=_ms_since(started))
        return tokenizer_pb2.EncodeResponse(token_ids=ids)

    async def Decode(
        self, request: tokenizer_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.DecodeResponse:
        ids = list(request.token_ids)
        started = time.perf_counter()
        text = await _run(len(ids), lambda: self._service.decode(ids, request.skip_special_tokens))
        _log.debug("decoded", tokens=len(ids), chars=len(text), ms=_ms_since(started))
        return tokenizer_pb2.DecodeResponse(text=text)

    async def RenderChat(
        self, request: tokenizer_pb2.RenderChatRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.RenderChatResponse:
        _check_chat_size(request)
        add_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        started = time.perf_counter()
        tools_json = request.tools_json
        # Off the event loop with the render: the calls' arguments are parsed there (up to
        # MAX_TOTAL_CONTENT_CHARS of JSON).
        rendered = await self._renderer.run(
            lambda: self._service.render_chat(messages_from_proto(request.messages), add_prompt, tools_json),
            "rendering the chat template")
        _log.debug("chat_rendered", messages=len(request.messages), tokens=len(rendered.token_ids),
                   ms=_ms_since(started))
        return tokenizer_pb2.RenderChatResponse(text=rendered.text, token_ids=rendered.token_ids)

    async def GetTokenizerInfo(
        self, request: tokenizer_pb2.GetTokenizerInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizerInfo:
        return self._info

    async def Detokenize(
        self, request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        self._next_stream_number += 1
        pool = self._service.new_detokenizer_pool()
        with logged_stream(_log, "detokenize", context, counters=("messages", "tokens"),
                           final=lambda: {"open_streams": len(pool)},
                           rpc="Detokenize", detokenize_call=self._next_stream_number) as stream:
            async for request in request_iterator:
                stream.add(messages=1, tokens=len(request.token_ids))
                yield self._detokenize_step(pool, request)

    def _detokenize_step(
        self, pool: DetokenizerPool, request: tokenizer_pb2.DetokenizeRequest
    ) -> tokenizer_pb2.DetokenizeResponse:
        batch = batch_from_proto(request)  # a malformed message (counts that do not add up) ends the call
        result = pool.apply(batch)  # a bad stream fails alone (DetokenizerPool.apply)
        for stream_id, reason in result.failed.items():
            _log.warning("detokenize_stream_failed", stream_id=stream_id, reason=reason)
        return result_to_proto(result, request.step_id)


    def close(self) -> None:
        self._renderer.close()


def _check_chat_size(request: tokenizer_pb2.RenderChatRequest) -> None:
    """The message and tool-call counts, then the serialized size (which bounds the text,
    tools_json included, from above), all read in place: 3 million empty messages, or as many
    empty calls in one, cost no dicts and no thread."""
    count = len(request.messages)
    if count > MAX_MESSAGES:
        raise InvalidArgumentError(f"messages has {count} entries; the limit MAX_MESSAGES is {MAX_MESSAGES}")
    check_tool_calls(sum(len(message.tool_calls) for message in request.messages))
    limit = 4 * MAX_TOTAL_CONTENT_CHARS + MESSAGE_FRAMING_BYTES * count
    if request.ByteSize() > limit:
        raise InvalidArgumentError(f"messages hold more than {MAX_TOTAL_CONTENT_CHARS} characters of roles and "
                                   f"content (the limit MAX_TOTAL_CONTENT_CHARS)")


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)
