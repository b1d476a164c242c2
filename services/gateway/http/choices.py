"""The engine streams of one HTTP request's choices: started together, read as one stream.

Each choice (prompt x n) is its own routed engine call. ``start`` begins them all and waits
for each one's first event, so that everything that can fail before a token is produced
(routing, the engine's validation, a tenant's budget) fails before the HTTP answer begins and
gets its own status; a stream that is already answering reports later failures in-band.
``events`` then yields (choice index, engine message) as they come; ``end`` cancels one call
whose reply is complete before the engine finished it (``parallel_tool_calls: false`` after its
call), and ``events`` yields nothing more of it; ``close`` cancels the calls still open (a client
that went away aborts its engine requests).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from services.common.errors import UnavailableError
from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2
from services.gateway.dispatch import Dispatcher
from services.gateway.routing.build import Route
from services.gateway.routing.request import RouteRequest

FINISH_NAMES = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_STOP: "stop",
                common_pb2.FINISH_REASON_EOS: "stop"}


@dataclass(slots=True)
class ChoiceState:
    """One choice as its events arrive: what a non-streamed answer and the usage are made of."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    """Every prompt token's (the engine's first delta, when asked); the first has none."""
    finish_reason: str | None = None
    stop_string: str | None = None
    """The stop string that ended the choice (the engine's FINISH_REASON_STOP), else None."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    estimated: bool = False
    """The counts are the gateway's, not the model's (an HTTP upstream that reported none)."""

    def apply(self, reply: generation_pb2.GenerateResponse) -> None:
        """Take one engine message in; a stream the engine ended badly raises UnavailableError."""
        kind = reply.WhichOneof("event")
        if kind == "delta":
            delta = reply.delta
            self.text.append(delta.text)
            self.completion_tokens += len(delta.token_ids)  # Finished's count replaces it
            if delta.logprobs:
                self.logprobs.extend(delta.logprobs)
            if delta.prompt_logprobs:
                self.prompt_logprobs.extend(delta.prompt_logprobs)
        elif kind == "started":
            self.prompt_tokens = reply.started.prompt_tokens
        elif kind == "finished":
            finished = reply.finished
            self.prompt_tokens = finished.usage.prompt_tokens or self.prompt_tokens
            self.completion_tokens = finished.usage.completion_tokens
            self.cached_tokens = finished.usage.cached_tokens
            self.estimated = finished.usage.estimated
            reason = FINISH_NAMES.get(finished.finish_reason)
            if reason is None:
                raise UnavailableError(f"the engine ended choice {self.index} without finishing it: "
                                       f"{finished.error_message or 'aborted'}")
            self.finish_reason = reason
            if finished.finish_reason == common_pb2.FINISH_REASON_STOP and finished.HasField("stop_reason"):
                self.stop_string = finished.stop_reason

    def end(self) -> None:
        """The gateway ended the choice with its reply whole (ChoiceStreams.end): finished as if
        the model had stopped there, its usage the tokens received."""
        self.finish_reason = "stop"


def usage_of(states: Sequence[ChoiceState]) -> dict:
    """OpenAI's usage: each prompt's tokens once (n choices share it), every choice's output;
    ``estimated: true`` where an HTTP upstream reported none (upstreams/usage.py counted it)."""
    prompts: dict[int, ChoiceState] = {}
    for state in states:
        prompts.setdefault(state.prompt_index, state)
    prompt_tokens = sum(s.prompt_tokens for s in prompts.values())
    completion = sum(s.completion_tokens for s in states)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
             "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in prompts.values())}}
    if any(s.estimated for s in states):  # counted by the gateway: the upstream reported none
        usage["estimated"] = True
    return usage


TARGET_HEADER = "x-tokenmill-target"


class ChoiceStreams:
    def __init__(self, dispatcher: Dispatcher, route: Route,
                 calls: Sequence[tuple[RouteRequest, generation_pb2.GenerateRequest]],
                 metadata: Sequence[tuple[str, str]] | None, timeout_s: float) -> None:
        self._streams = [dispatcher.generate(route, rr, message, metadata, timeout_s) for rr, message in calls]
        self._dispatcher = dispatcher
        self._request_ids = [message.request_id for _, message in calls]
        self.targets: list[str] = []
        """The targets serving the calls, once started (first appearance order, no repeats)."""
        self._first: list[generation_pb2.GenerateResponse] = []
        self._pumps: list[asyncio.Task] = []
        self._ended: set[int] = set()

    async def start(self) -> None:
        """Every call's first event (their first tokens); the first failure raises, after closing all."""
        try:
            if len(self._streams) == 1:
                self._first = [await anext(self._streams[0])]
                self._note_targets()
                return
            results = await asyncio.gather(*(anext(s) for s in self._streams), return_exceptions=True)
        except BaseException:
            await self.close()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]
        self._first = list(results)
        self._note_targets()

    def _note_targets(self) -> None:
        # Each call has its Started now, so the dispatcher holds the target that admitted it.
        live = self._dispatcher.live
        names = (live[rid].name for rid in self._request_ids if rid in live)
        self.targets = list(dict.fromkeys(names))

    @property
    def target_header(self) -> dict[str, str]:
        """``x-tokenmill-target``: which target(s) serve this response."""
        return {TARGET_HEADER: ", ".join(self.targets)} if self.targets else {}

    def prompt_tokens(self) -> int:
        """After ``start``: the first choice's prompt length, from its Started event (0 if the
        engine sent none first)."""
        first = self._first[0] if self._first else None
        return first.started.prompt_tokens if first is not None and first.WhichOneof("event") == "started" else 0

    async def events(self) -> AsyncIterator[tuple[int, generation_pb2.GenerateResponse]]:
        if len(self._streams) == 1:
            yield 0, self._first[0]
            async for reply in self._streams[0]:
                yield 0, reply
            return
        queue: asyncio.Queue = asyncio.Queue()
        for index, first in enumerate(self._first):
            queue.put_nowait((index, first))
        self._pumps = [asyncio.create_task(self._pump(i, s, queue)) for i, s in enumerate(self._streams)]
        open_streams = len(self._streams)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif index in self._ended:
                continue
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    @staticmethod
    async def _pump(index: int, stream: AsyncIterator, queue: asyncio.Queue) -> None:
        try:
            async for reply in stream:
                queue.put_nowait((index, reply))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((index, exc))
        finally:  # cancelled by end() too: the reader counts the stream closed
            queue.put_nowait((index, None))

    async def end(self, index: int) -> None:
        """Cancel choice ``index``'s engine call now (the engine aborts it at its next step); call
        it between two events of ``events``, which yields no more of that choice."""
        self._ended.add(index)
        if self._pumps:
            self._pumps[index].cancel()
            await asyncio.gather(self._pumps[index], return_exceptions=True)
        # One stream: events() is paused on its yield, so closing it ends the loop over it.
        await self._streams[index].aclose()

    async def close(self) -> None:
        for task in self._pumps:
            task.cancel()
        if self._pumps:
            await asyncio.gather(*self._pumps, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()
