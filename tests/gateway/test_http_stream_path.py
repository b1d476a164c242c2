"""The HTTP streaming path's own parts: the coalescing transport, the event stream's disconnect
watch, and ``unless_disconnected``, driven with the ASGI messages a server sends."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.http.coalescing import FLUSH_BYTES, CoalescingTransport
from services.gateway.http.disconnect import ClientDisconnected, unless_disconnected
from services.gateway.http.streaming import EventStream


class RecordingTransport(asyncio.Transport):
    """What a socket would have been asked to send, one entry per write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0


async def test_writes_of_one_loop_turn_go_out_as_one():
    raw = RecordingTransport()
    transport = CoalescingTransport(raw, asyncio.get_running_loop())
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    transport.write(b"c0\r\ndata: {}\r\n")
    assert raw.writes == [] and transport.get_write_buffer_size() > 0
    await asyncio.sleep(0)
    assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\nc0\r\ndata: {}\r\n"]
    transport.write(b"e\r\ndata: [DONE]\n\n\r\n")
    await asyncio.sleep(0)
    transport.write(b"0\r\n\r\n")
    transport.close()  # what is held goes before the close
    assert raw.writes[1:] == [b"e\r\ndata: [DONE]\n\n\r\n", b"0\r\n\r\n"] and raw.closed
    await asyncio.sleep(0)  # the scheduled flush finds nothing held
    assert len(raw.writes) == 3


async def test_a_large_write_is_not_held_and_a_closed_connection_drops_what_is():
    raw = RecordingTransport()
    transport = CoalescingTransport(raw, asyncio.get_running_loop())
    transport.write(b"x" * FLUSH_BYTES)
    assert raw.writes == [b"x" * FLUSH_BYTES]
    transport.write(b"late")
    raw.closed = True  # the client went away before the turn ended
    await asyncio.sleep(0)
    assert len(raw.writes) == 1
    transport.write(b"held")
    transport.abort()
    await asyncio.sleep(0)
    assert raw.aborted and len(raw.writes) == 1


class Client:
    """An ASGI server's side of one streamed answer: ``receive`` gives http.disconnect once
    ``leave`` is set; ``send`` records the messages."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.leave = asyncio.Event()

    async def receive(self) -> dict:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)


async def test_a_client_that_goes_away_between_tokens_closes_the_stream_at_once():
    closed = asyncio.Event()
    stalled = asyncio.Event()

    async def frames():
        try:
            yield b"data: 1\n\n"
            stalled.set()
            await asyncio.Event().wait()  # the engine's next token, which never comes
            yield b"data: 2\n\n"
        finally:
            closed.set()  # where the engine calls are closed (event_stream)

    client = Client()
    answer = asyncio.create_task(EventStream(frames(), media_type="text/event-stream")({"type": "http"},
                                                                                        client.receive, client.send))
    await stalled.wait()
    client.leave.set()
    await asyncio.wait_for(answer, 5)  # returns, neither cancelled nor raising
    assert closed.is_set()
    assert [m["type"] for m in client.sent] == ["http.response.start", "http.response.body"]
    assert client.sent[1]["body"] == b"data: 1\n\n"


async def test_an_event_stream_sends_every_frame_then_ends_and_a_server_cancel_propagates():
    client = Client()

    async def frames():
        yield b"a"
        yield b"b"

    async def handler() -> int:
        await EventStream(frames())({"type": "http"}, client.receive, client.send)
        return asyncio.current_task().cancelling()

    assert await handler() == 0  # the watcher left nothing cancelled behind
    assert [m.get("body") for m in client.sent] == [None, b"a", b"b", b""]
    assert client.sent[-1]["more_body"] is False

    cancelled = asyncio.Event()

    async def endless():
        try:
            yield b"a"
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    task = asyncio.create_task(EventStream(endless())({"type": "http"}, Client().receive, Client().send))
    await asyncio.sleep(0.01)
    task.cancel()  # the server stopping: not a disconnect, so it is not swallowed
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled.is_set()


class Request:
    """What ``unless_disconnected`` reads of a Starlette request."""

    def __init__(self, client: Client) -> None:
        self.receive = client.receive


async def test_unless_disconnected_returns_the_work_or_cancels_it_when_the_client_leaves():
    client = Client()
    assert await unless_disconnected(Request(client), asyncio.sleep(0, "done")) == "done"
    assert asyncio.current_task().cancelling() == 0

    cleaned = asyncio.Event()

    async def work():
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    async def leave_soon():
        await asyncio.sleep(0.01)
        client.leave.set()

    leaving = asyncio.create_task(leave_soon())
    with pytest.raises(ClientDisconnected):
        await unless_disconnected(Request(client), work())
    await leaving
    assert cleaned.is_set() and asyncio.current_task().cancelling() == 0
