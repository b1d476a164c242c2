"""An OpenAI-dialect upstream that misbehaves every way an HTTP server can, behind the gateway, seen
through the official ``openai`` client (``max_retries=0``):

- one that accepts and never answers, and one that stalls after its first token: 504 / an in-band
  error once the target's ``total_s`` is spent, never a hang;
- garbage for an event, a line that never ends (the gateway stops reading at MAX_EVENT_BYTES: the
  upstream could write only a bounded amount before the answer came back), a stream that never
  ends (cut at ``total_s``), a 200 that is HTML, a redirect (not followed): each a clear error
  naming what was wrong;
- while they misbehave, a request to a well-behaved upstream of the same gateway answers at once;
- afterwards no call is left open at the gateway and every connection to the hostile server has
  been closed by the gateway; the good upstream, which streams no usage, gets the gateway's
  estimate marked ``estimated``.

The hostile server is a plain asyncio socket server in the test's process (an adversary, not one
of the project's services); the gateway runs its real serve() on free ports.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio

from services.gateway.upstreams.client import MAX_EVENT_BYTES
from tests.helpers.gateway_stack import serve_gateway_for, stop_all, wait_healthy, write_routes

pytestmark = [pytest.mark.asyncio(loop_scope="module")]

CASES = ("stall", "stall_mid", "garbage", "oversized", "endless", "html", "redirect", "good")
TOTAL_S = 2.0


def chunk(text: str = "", finish: str | None = None) -> bytes:
    payload = {"id": "x", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}]}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


class Hostile:
    def __init__(self) -> None:
        self.port = 0
        self.open: Counter[str] = Counter()
        """Connections of each case still open (the gateway's calls, health probes not counted)."""
        self.hits: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        """Body bytes written per case."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, path = head.split(b" ")[:2]
            case = path.decode().split("/")[1]
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            self.hits[case] += 1
            if method == b"GET":
                body = b'{"object":"list","data":[]}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                return
            self.open[case] += 1
            try:
                await self.answer(case, reader, writer)
            finally:
                self.open[case] -= 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def write(self, case: str, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        self.sent[case] += len(data)
        await writer.drain()

    async def answer(self, case: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if case == "stall":
            await reader.read()  # nothing, until the gateway closes the connection
        if case == "html":
            body = b"<html><body>Welcome to nginx!</body></html>"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
            return await writer.drain()
        if case == "redirect":
            writer.write(b"HTTP/1.1 302 Found\r\nlocation: http://127.0.0.1:%d/leak/v1/chat/completions\r\n"
                         b"content-length: 0\r\n\r\n" % self.port)
            return await writer.drain()
        writer.write(SSE_HEAD)
        if case == "stall_mid":
            await self.write(case, writer, chunk("Hi"))
            await reader.read()
        elif case == "garbage":
            await self.write(case, writer, b"data: {\"choices\": [oops\n\n")
        elif case == "oversized":
            await self.write(case, writer, b'data: {"choices":[{"index":0,"delta":{"content":"')
            while True:  # one line without end, as fast as the gateway takes it
                await self.write(case, writer, b"x" * 65536)
        elif case == "endless":
            while True:
                await self.write(case, writer, chunk("a"))
                await asyncio.sleep(0.005)
        elif case == "good":
            for piece in ("The", " capital", " is Paris."):
                await self.write(case, writer, chunk(piece))
            await self.write(case, writer, chunk(finish="stop") + b"data: [DONE]\n\n")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def front(tmp_path_factory) -> AsyncIterator[tuple[openai.AsyncOpenAI, Hostile, object]]:
    hostile = Hostile()
    server = await asyncio.start_server(hostile.handle, "127.0.0.1", 0)
    hostile.port = server.sockets[0].getsockname()[1]
    targets = [{"name": case, "kind": "openai", "url": f"http://127.0.0.1:{hostile.port}/{case}/v1", "model": "m",
                "timeouts": {"total_s": 30 if case == "oversized" else TOTAL_S}} for case in CASES]
    routes = write_routes(tmp_path_factory.mktemp("hostile") / "routes.json",
                          {"targets": targets, "models": {case: case for case in CASES}})
    gateway = await serve_gateway_for(routes)
    await wait_healthy(gateway, list(CASES))
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="unused",
                                max_retries=0, timeout=60)
    yield client, hostile, gateway
    await client.close()
    await stop_all([gateway])
    server.close()


async def ask(client: openai.AsyncOpenAI, model: str, stream: bool) -> tuple[str, Exception | None, float]:
    """(text received, the error raised or None, seconds taken)."""
    began, text = time.monotonic(), ""
    try:
        if not stream:
            answer = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}])
            return answer.choices[0].message.content, None, time.monotonic() - began
        async for part in await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hi"}], stream=True):
            if part.choices and part.choices[0].delta.content:
                text += part.choices[0].delta.content
    except openai.APIError as exc:
        return text, exc, time.monotonic() - began
    return text, None, time.monotonic() - began


def status_of(error: Exception | None) -> int | None:
    return getattr(error, "status_code", None)


async def test_a_hostile_upstream_gets_clear_errors_and_harms_no_other_request(front):
    client, hostile, gateway = front
    hostile_calls = [ask(client, case, stream) for case in CASES[:-1] for stream in (False, True)]
    slow = asyncio.gather(*hostile_calls)
    await asyncio.sleep(0.3)  # all of them in flight (the stalls and the endless stream hold on)
    text, error, took = await ask(client, "good", stream=True)
    assert (text, error) == ("The capital is Paris.", None)
    assert took < 1.5, f"a well-behaved upstream's answer took {took:.2f} s beside the hostile ones"
    results = dict(zip([(case, stream) for case in CASES[:-1] for stream in (False, True)], await slow))

    for stream in (False, True):
        text, error, took = results["stall", stream]
        assert status_of(error) == 504 and "no answer in time" in str(error), error
        assert TOTAL_S - 0.2 <= took < TOTAL_S + 3
    text, error, _ = results["stall_mid", False]
    assert status_of(error) == 504 and f"took more than {TOTAL_S:g} s" in str(error), error
    text, error, took = results["stall_mid", True]  # the first token went out: the error comes in-band
    assert text == "Hi" and error is not None and f"took more than {TOTAL_S:g} s" in str(error), (text, error)
    for stream in (False, True):
        text, error, _ = results["garbage", stream]
        assert status_of(error) == 500 and "sent an event that is not JSON" in str(error), error
        text, error, took = results["oversized", stream]
        assert status_of(error) == 500 and f"event line longer than {MAX_EVENT_BYTES} bytes" in str(error), error
        assert took < 15, took  # ended by the cap, not by its 30 s total_s
        text, error, _ = results["html", stream]
        assert status_of(error) == 500 and "'text/html', not an event stream" in str(error), error
        text, error, _ = results["redirect", stream]
        assert status_of(error) == 500 and "redirects are not followed" in str(error), error
    text, error, _ = results["endless", False]
    assert status_of(error) == 504 and f"took more than {TOTAL_S:g} s" in str(error), error
    text, error, _ = results["endless", True]
    assert len(text) > 10 and set(text) == {"a"} and f"took more than {TOTAL_S:g} s" in str(error), (len(text), error)
    # The gateway read at most the cap (plus what socket buffers hold) of each endless line.
    assert hostile.sent["oversized"] < 2 * (MAX_EVENT_BYTES + (8 << 20)), hostile.sent["oversized"]
    assert hostile.hits["leak"] == 0  # the redirect was not followed

    # Nothing left open: no call at the gateway, no connection to the hostile server.
    deadline = time.monotonic() + 5
    while any(hostile.open.values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not any(hostile.open.values()), hostile.open
    for case in CASES:
        assert not gateway.dispatcher.pool.targets[case].upstream.live, case
    # and the gateway still serves; this upstream reports no usage: the gateway's count, marked so
    answer = await client.chat.completions.create(model="good", messages=[{"role": "user", "content": "Hi there"}])
    assert answer.choices[0].message.content == "The capital is Paris."
    usage = answer.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.model_extra) == (2, 3, {"estimated": True})
