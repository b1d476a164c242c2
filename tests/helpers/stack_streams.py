"""Client-side helpers for tests of the public Generation API: record whole Generate streams
and check what a client sees (framing, text, finish reasons)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio

from services.stack.client import build_request
from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2
from services.tokenizer.text_tokenizer import TextTokenizer

REPLACEMENT_CHAR = "\ufffd"
STREAM_TIMEOUT_S = 60.0
"""Client deadline of one Generate call: far above any stream these tests start, so a hang
shows up as DEADLINE_EXCEEDED instead of a stuck test."""


@dataclass
class StreamRecord:
    """Everything one Generate call delivered, and the status it ended with."""

    messages: list[generation_pb2.GenerateResponse] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    ended_at: float = 0.0
    """time.monotonic() when the call ended (its last message or its error)."""

    def kinds(self) -> list[str]:
        return [m.WhichOneof("event") for m in self.messages]

    @property
    def started(self) -> generation_pb2.Started | None:
        first = self.messages[0] if self.messages else None
        return first.started if first is not None and first.WhichOneof("event") == "started" else None

    @property
    def finished(self) -> generation_pb2.Finished | None:
        last = self.messages[-1] if self.messages else None
        return last.finished if last is not None and last.WhichOneof("event") == "finished" else None

    @property
    def deltas(self) -> list[generation_pb2.Delta]:
        return [m.delta for m in self.messages if m.WhichOneof("event") == "delta"]

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    @property
    def finish_reason(self) -> str:
        """One of length, eos, stop, abort, error; empty when no Finished arrived."""
        if self.finished is None:
            return ""
        return common_pb2.FinishReason.Name(self.finished.finish_reason).removeprefix("FINISH_REASON_").lower()


def greedy_request(prompt: str | list[int], max_tokens: int, *, request_id: str = "", ignore_eos: bool = True,
                   stop: Sequence[str] = ()) -> generation_pb2.GenerateRequest:
    request = build_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, stop=stop)
    request.request_id = request_id
    return request


async def record_stream(stub, request: generation_pb2.GenerateRequest, *, timeout: float = STREAM_TIMEOUT_S,
                        cancel_after_deltas: int | None = None,
                        on_delta: asyncio.Event | None = None) -> StreamRecord:
    """Read one Generate stream to its end. A failed call is recorded (code, details), not raised.

    cancel_after_deltas: cancel the call once that many deltas with tokens arrived (the client
    going away mid-stream); the record then ends with CANCELLED. on_delta is set at the first
    delta with tokens (the request is running).
    """
    record = StreamRecord()
    call = stub.Generate(request, timeout=timeout)
    with_tokens = 0
    try:
        async for message in call:
            record.messages.append(message)
            if message.WhichOneof("event") == "delta" and message.delta.token_ids:
                with_tokens += 1
                if on_delta is not None:
                    on_delta.set()
                if cancel_after_deltas is not None and with_tokens >= cancel_after_deltas:
                    call.cancel()
                    record.code = grpc.StatusCode.CANCELLED
                    break
    except grpc.aio.AioRpcError as err:
        record.code, record.details = err.code(), err.details() or ""
    record.ended_at = time.monotonic()
    return record


def assert_framed(record: StreamRecord, *, prompt_tokens: int, request_id: str | None = None) -> None:
    """Started first, then only deltas, then exactly one Finished whose usage agrees with the deltas."""
    assert record.code == grpc.StatusCode.OK, (record.code, record.details)
    kinds = record.kinds()
    assert kinds[0] == "started" and kinds[-1] == "finished", kinds
    assert set(kinds[1:-1]) <= {"delta"}, kinds
    assert record.started.prompt_tokens == prompt_tokens
    if request_id is None:
        assert record.started.request_id  # the server assigned one
    else:
        assert record.started.request_id == request_id
    usage = record.finished.usage
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == len(record.token_ids)
    timings = record.finished.timings
    assert timings.time_to_first_token_ms > 0
    assert timings.e2e_ms >= timings.time_to_first_token_ms
    assert timings.decode_time_ms >= 0 and timings.queue_time_ms >= 0


def continuation_text(tokenizer: TextTokenizer, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str:
    """The text the output adds to the prompt: decode(prompt + output) minus decode(prompt)."""
    head = tokenizer.decode(list(prompt_ids))
    full = tokenizer.decode(list(prompt_ids) + list(output_ids))
    assert full.startswith(head), (head, full)
    return full[len(head):]


def assert_no_stray_replacement_chars(record: StreamRecord) -> None:
    """A delta shows U+FFFD only when the final text has one (no half-decoded characters)."""
    if REPLACEMENT_CHAR not in record.text:
        assert not [d.text for d in record.deltas if REPLACEMENT_CHAR in d.text]
