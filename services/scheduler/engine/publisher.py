"""The engine loop's output stage: each step's updates become text, then the clients' deltas.

Fed in step order by the loop (``put``), it runs beside it (``run``, the services) or when
asked (``drain``, the in-process engine), so the next executor step is never held up by a
detokenizer round trip. Each step's tokens go to the detokenizer their request is pinned
to, one batch per detokenizer (services/common/detokenize.py); the text that comes back is
final: cut at a stop string by the detokenizer, which matches them where the text is made.
A request whose text reached a stop string ends in the scheduler core at the next step
boundary (the extra tokens computed meanwhile are never shown).

Steps that queued while the previous batch was awaited (the output stage fell behind the
loop, as it does when the cores are contended) go out as one batch per detokenizer: each
batch is a write and a read in two processes. Only while no request of theirs has stop
strings: those need their text at once, to stop at the right token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from services.common.detokenize import DetokenizeBatch, NewTextStream
from services.common.errors import UnavailableError
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.update import RequestUpdate
from services.scheduler.engine.ports import DetokenizerPort
from services.scheduler.engine.request_table import RequestTable
from services.scheduler.engine.step_times import StepTimeTotals
from services.scheduler.request.stream import RequestStream

_log = structlog.get_logger("tokenmill.scheduler")

PROMPT_CONTEXT_TOKENS = 8
"""Prompt tail sent with a new text stream: enough to space the first output token."""

TEXT_FAILED = "the text of this request's output could not be made"
"""What a request hears when its detokenizer refused its stream (the reason is logged)."""


@dataclass(slots=True)
class _Published:
    """One step's updates on their way to the detokenizers, in step order."""

    updates: list[RequestUpdate]
    closed: list[tuple[int, int]]
    """(stream id, detokenizer index) of text streams to close after this step."""


class Publisher:
    def __init__(self, requests: RequestTable, detokenizers: Sequence[DetokenizerPort], clock: Callable[[], float],
                 totals: StepTimeTotals) -> None:
        self._requests = requests
        self._detokenizers = detokenizers
        self._clock = clock
        self._totals = totals
        self._queue: asyncio.Queue[_Published] = asyncio.Queue()

    def put(self, updates: list[RequestUpdate], closed: list[tuple[int, int]]) -> None:
        self._queue.put_nowait(_Published(updates, closed))

    async def run(self) -> None:
        """Publish forever, as steps come (the services' output task)."""
        while True:
            items = [await self._queue.get()]
            await self._publish(self._take(items))

    async def drain(self) -> None:
        """Publish every step queued so far (the in-process engine, after each step)."""
        items = self._take([])
        if items:
            await self._publish(items)

    def _take(self, items: list[_Published]) -> list[_Published]:
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items

    async def _publish(self, items: list[_Published]) -> None:
        groups = [items] if len(items) > 1 and all(map(self._text_can_wait, items)) else [[i] for i in items]
        for group in groups:
            try:
                await self._publish_steps(group)
            except Exception as exc:  # noqa: BLE001 - the output stage must outlive any one step
                _log.exception("publish_failed", error=str(exc))
                for update in (u for item in group for u in item.updates):
                    stream = self._requests.get(update.request_id)
                    if stream is not None:
                        self._requests.end(stream, FinishReason.ERROR, TEXT_FAILED)  # details: logged above

    def _text_can_wait(self, item: _Published) -> bool:
        """No request of `item` has stop strings (whose text must be checked step by step)."""
        for update in item.updates:
            entry = self._requests.get(update.request_id)
            if entry is not None and entry.request.stop.stop:
                return False
        return True

    async def _publish_steps(self, items: list[_Published]) -> None:
        """Detokenize and publish the updates of ``items`` (consecutive steps, oldest first). A
        stream's text goes to its last update; the earlier ones publish their tokens with
        empty text."""
        self._totals.detokenize_rounds += 1
        batches, live = _batches(self._requests, len(self._detokenizers), items)
        text = await _detokenize(self._detokenizers, batches)
        _deliver(self._requests, live, text, self._clock())


@dataclass(slots=True)
class _Text:
    """What the detokenizers made of one round, by stream id."""

    texts: dict[int, str] = field(default_factory=dict)
    stopped: dict[int, str] = field(default_factory=dict)
    """Streams cut at a stop string: the string."""
    failed: dict[int, str] = field(default_factory=dict)
    """Streams whose text could not be made: why."""


async def _detokenize(detokenizers: Sequence[DetokenizerPort], batches: list[DetokenizeBatch]) -> _Text:
    """Each non-empty batch to its detokenizer; the replies merged. A lost detokenizer's
    requests have ended already; any other failure is raised."""
    active = [i for i, b in enumerate(batches) if not b.is_empty and detokenizers[i].connected]
    if len(active) == 1:
        # One detokenizer (the usual stack): awaited directly, since gather wraps each call in
        # a Task: 14-18 us of CPU per step, measured on a 2-core CPU (docs/benchmarks.md).
        try:
            replies = [await detokenizers[active[0]].detokenize(batches[active[0]])]
        except Exception as exc:  # noqa: BLE001 - sorted below as gather's would be
            replies = [exc]
    else:
        replies = await asyncio.gather(*(detokenizers[i].detokenize(batches[i]) for i in active),
                                       return_exceptions=True)
    text = _Text()
    for reply in replies:
        if isinstance(reply, UnavailableError):
            _log.error("detokenize_failed", error=str(reply))  # its requests end via the supervisor
        elif isinstance(reply, BaseException):
            raise reply
        else:
            text.texts.update(reply.texts)
            text.stopped.update(reply.stopped)
            text.failed.update(reply.failed)
    return text


def _batches(requests: RequestTable, num_detokenizers: int,
             items: list[_Published]) -> tuple[list[DetokenizeBatch], list[tuple[RequestUpdate, RequestStream]]]:
    """One batch per detokenizer for ``items`` (a stream's tokens of several steps in one
    entry), and the updates of requests still live, in order."""
    batches = [DetokenizeBatch() for _ in range(num_detokenizers)]
    live: list[tuple[RequestUpdate, RequestStream]] = []
    entries: dict[int, list[int]] = {}
    """stream id -> its token list in a batch (several steps' tokens appended to one)."""
    for update in (u for item in items for u in item.updates):
        stream = requests.get(update.request_id)
        if stream is None:
            continue  # ended meanwhile
        batch = batches[stream.detokenizer]
        if not stream.stream_opened:
            stream.stream_opened = True
            request = stream.request
            batch.new_streams.append(NewTextStream(
                stream.stream_id, request.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:], request.stop.stop,
                request.stop.include_stop_str_in_output))
        if stream.stream_id in entries:
            entries[stream.stream_id].extend(update.new_token_ids)
        else:
            entries[stream.stream_id] = ids = list(update.new_token_ids)
            batch.appended.append((stream.stream_id, ids))
        live.append((update, stream))
    for stream_id, index in (c for item in items for c in item.closed):
        batches[index].closed.append(stream_id)
    return batches, live


def _deliver(requests: RequestTable, live: list[tuple[RequestUpdate, RequestStream]], made: _Text,
             now: float) -> None:
    """Each live update's delta to its client: a stream's text with its last update of the round."""
    texts, stopped, failed = made.texts, made.stopped, made.failed
    last = {stream.stream_id: position for position, (_, stream) in enumerate(live)}
    for position, (update, stream) in enumerate(live):
        if requests.get(update.request_id) is not stream:
            continue
        if stream.stream_id in failed:  # this stream alone: the detokenizer serves the others on
            _log.error("request_text_failed", request_id=update.request_id, reason=failed[stream.stream_id])
            requests.end(stream, FinishReason.ERROR, TEXT_FAILED)
            continue
        is_last = last[stream.stream_id] == position
        text = texts.get(stream.stream_id, "") if is_last else ""
        stop_string = stopped.get(stream.stream_id) if is_last else None
        delta = stream.on_update(update, text, now, stop_string)
        if stop_string is not None and update.finish_reason is None:
            requests.stopped_by_string(stream, stop_string)  # the core still runs it
        requests.deliver(stream, delta)
