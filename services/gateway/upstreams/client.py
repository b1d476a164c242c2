"""One HTTP upstream: its client (credentials, TLS, connect timeout), its calls, its health probe.

A call sends the GenerateRequest translated by the target's dialect (openai.py, anthropic.py),
streamed (so the gateway sees each token arrive and can measure the upstream: the passive
profile; a target's ``stream_tools: false`` asks for tool-offering requests whole, read as one
chunk), and yields the engines' events: Started once the upstream answered 200, a Delta per
piece of text, Finished with the upstream's finish reason and usage. Anything that goes wrong
leaves as a gRPC status (errors.py); a stream that breaks off before its end is UNAVAILABLE, which
the dispatcher retries only while no token was sent.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx2
import structlog

from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2
from services.gateway.routes_file import TargetSpec
from services.gateway.upstreams.dialect import Dialect, StreamReader
from services.gateway.upstreams.errors import rpc_error, status_error
from services.gateway.upstreams.usage import UsageCounter

_log = structlog.get_logger("tokenmill.gateway.upstream")

MAX_ERROR_BODY = 4096
"""Bytes of an error answer read to quote it."""
MAX_EVENT_BYTES = 1 << 20
"""Bytes of one line of an upstream's event stream: a line growing past this (an upstream that
never sends a newline) ends the call, instead of the gateway buffering it without bound."""
MAX_WHOLE_BYTES = 16 << 20
"""Bytes of a whole (unstreamed) reply (a target's ``stream_tools: false``)."""


def _verify(spec: TargetSpec) -> ssl.SSLContext | bool:
    tls = spec.tls
    if tls is None:
        return True
    if not tls.verify:
        return False
    context = ssl.create_default_context(cafile=tls.ca or None)
    if tls.cert:
        context.load_cert_chain(tls.cert, tls.key)
    return context


class HttpUpstream:
    def __init__(self, spec: TargetSpec, dialect: Dialect) -> None:
        self.spec = spec
        self.dialect = dialect
        connect = spec.timeouts.connect_s or None
        # trust_env off: an HTTP(S)_PROXY meant for the gateway's users must not reroute its upstreams.
        self.client = httpx2.AsyncClient(
            verify=_verify(spec), trust_env=False,
            timeout=httpx2.Timeout(None, connect=connect),
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=64))
        self.headers = dialect.headers(spec.token)
        self.usage = UsageCounter(spec.tokenizer)
        self.live: dict[str, UpstreamCall] = {}
        self._refused_probe = False

    def generate(self, message: generation_pb2.GenerateRequest, timeout_s: float) -> UpstreamCall:
        return UpstreamCall(self, message, timeout_s)

    def abort(self, request_id: str) -> bool:
        call = self.live.get(request_id)
        if call is None:
            return False
        call.abort()
        return True

    async def probe(self, timeout_s: float) -> bool | None:
        """Serving: the dialect's listing (GET models) answers below 500 and takes the key; None:
        no answer within ``timeout_s`` (slow, which the pool tells from gone)."""
        try:
            response = await self.client.get(self.spec.address + self.dialect.health_path, headers=self.headers,
                                             timeout=timeout_s)
        except httpx2.TimeoutException:
            return None
        except httpx2.HTTPError:
            return False
        if response.status_code in (401, 403):
            if not self._refused_probe:
                _log.warning("upstream_refuses_the_gateway", target=self.spec.name, status=response.status_code,
                             fix=f"the key in target '{self.spec.name}''s token_env is not one the upstream accepts")
            self._refused_probe = True
            return False
        self._refused_probe = False
        return response.status_code < 500

    async def close(self) -> None:
        await self.client.aclose()


class UpstreamCall:
    """One request to the upstream, iterated like a gRPC Generate call (and cancelled like one)."""

    def __init__(self, upstream: HttpUpstream, message: generation_pb2.GenerateRequest, timeout_s: float) -> None:
        self.upstream = upstream
        self.message = message
        self.timeout_s = timeout_s
        self._response: httpx2.Response | None = None
        self._streamed = True
        """False: the dialect asked for the whole reply (a target's stream_tools: false)."""
        self._aborted = False
        self._events = self._run()

    def __aiter__(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        return self._events

    def cancel(self) -> None:
        """The client went away: close the upstream's stream (the upstream stops generating)."""
        asyncio.ensure_future(self._events.aclose())

    def abort(self) -> None:
        self._aborted = True
        if self._response is not None:
            asyncio.ensure_future(self._response.aclose())

    async def _run(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        upstream, message = self.upstream, self.message
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        request_id = message.request_id
        upstream.live[request_id] = self
        reader = upstream.dialect.reader(message)
        started = False
        try:
            response = await self._send(deadline)
            async for event, payload in self._payloads(response, reader, deadline):
                reader.feed(event, payload)
                for text in reader.take():
                    if not started:
                        started = True
                        yield _started(request_id, reader)
                    yield generation_pb2.GenerateResponse(delta=generation_pb2.Delta(text=text))
            if self._aborted:
                reader.finish = common_pb2.FINISH_REASON_ABORT
            elif reader.finish is None:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                                f"upstream {upstream.spec.name} ended the stream before its end")
            for text in reader.take():
                yield generation_pb2.GenerateResponse(delta=generation_pb2.Delta(text=text))
            if not started:
                yield _started(request_id, reader)
            yield generation_pb2.GenerateResponse(finished=self._finished(reader))
        finally:
            if upstream.live.get(request_id) is self:
                del upstream.live[request_id]
            if self._response is not None:
                await self._response.aclose()

    async def _send(self, deadline: float) -> httpx2.Response:
        """The upstream's answer once it is a 200 event stream; anything else a gRPC status."""
        upstream, name = self.upstream, self.upstream.spec.name
        loop = asyncio.get_running_loop()
        path, body = upstream.dialect.build(self.message)
        self._streamed = body.get("stream", True)
        request = upstream.client.build_request("POST", upstream.spec.address + path, json=body,
                                                headers=upstream.headers)
        try:
            response = await asyncio.wait_for(upstream.client.send(request, stream=True), deadline - loop.time())
        except (TimeoutError, httpx2.TimeoutException) as exc:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED if loop.time() >= deadline
                            else grpc.StatusCode.UNAVAILABLE, f"upstream {name}: no answer in time",
                            reached=not isinstance(exc, httpx2.ConnectTimeout)) from None
        except httpx2.HTTPError as exc:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"upstream {name} cannot be reached: {exc!r}",
                            reached=not isinstance(exc, httpx2.ConnectError)) from None
        self._response = response  # closed by _run whatever is raised below
        if response.status_code != 200:
            if response.is_redirect:
                raise rpc_error(grpc.StatusCode.INTERNAL, f"upstream {name} answered HTTP {response.status_code} "
                                f"to {response.headers.get('location', '')[:200]!r}; redirects are not followed "
                                f"(set the target's url to where it serves)")
            said = await _error_body(response)
            raise status_error(name, response.status_code, said, response.headers.get("retry-after"))
        content_type = response.headers.get("content-type", "")
        if not content_type.startswith("text/event-stream" if self._streamed else "application/json"):
            wanted = "an event stream (text/event-stream)" if self._streamed else "JSON"
            raise rpc_error(grpc.StatusCode.INTERNAL, f"upstream {name} answered {content_type[:100]!r}, not {wanted}")
        return response

    async def _payloads(self, response: httpx2.Response, reader: StreamReader,
                        deadline: float) -> AsyncIterator[tuple[str, Any]]:
        """(event name, decoded JSON) of each data line, until [DONE], the reader's end or an abort."""
        name = self.upstream.spec.name
        lines = sse_lines(response, name) if self._streamed else whole_lines(response, name, self.upstream.dialect)
        event = ""
        while not reader.done:
            try:
                # timeout_at, not wait_for: no task made per line (one event-loop turn less a token)
                async with asyncio.timeout_at(deadline):
                    line = await anext(lines)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"upstream {name}: the request took more than {self.timeout_s:g} s") from None
            except (httpx2.HTTPError, RuntimeError) as exc:  # aclose() by abort: httpx's StreamClosed
                if self._aborted:
                    return
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"upstream {name} broke off the stream: {exc!r}") \
                    from None
            if line.startswith("event:"):
                event = line[6:].strip()
                continue
            if not line.startswith("data:"):
                if not line:
                    event = ""
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                payload = json.loads(data)
            except ValueError:
                raise rpc_error(grpc.StatusCode.INTERNAL, f"upstream {name} sent an event that is not JSON: "
                                                          f"{data[:200]!r}") from None
            yield event, payload

    def _finished(self, reader: StreamReader) -> generation_pb2.Finished:
        finished = generation_pb2.Finished(finish_reason=reader.finish, usage=common_pb2.Usage(
            prompt_tokens=reader.prompt_tokens, completion_tokens=reader.completion_tokens,
            cached_tokens=reader.cached_tokens))
        if not reader.prompt_reported:
            finished.usage.prompt_tokens = self.upstream.usage.prompt_tokens(self.message)
            finished.usage.estimated = True
        if not reader.completion_reported:  # counted one a streamed piece (usage.py)
            finished.usage.estimated = True
        if reader.stop_reason is not None:
            finished.stop_reason = reader.stop_reason
        return finished


def _started(request_id: str, reader: StreamReader) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(started=generation_pb2.Started(request_id=request_id,
                                                                          prompt_tokens=reader.prompt_tokens))


async def sse_lines(response: httpx2.Response, name: str) -> AsyncIterator[str]:
    """The stream's lines (``\\n`` or ``\\r\\n`` ended), none longer than MAX_EVENT_BYTES."""
    buffer = b""
    async for chunk in response.aiter_bytes():
        buffer = buffer + chunk if buffer else chunk
        if b"\n" in chunk:
            *complete, buffer = buffer.split(b"\n")
            for line in complete:
                if len(line) > MAX_EVENT_BYTES:
                    raise _too_long(name)
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if len(buffer) > MAX_EVENT_BYTES:
            raise _too_long(name)
    if buffer:
        yield buffer.rstrip(b"\r").decode("utf-8", errors="replace")


async def whole_lines(response: httpx2.Response, name: str, dialect) -> AsyncIterator[str]:
    """A whole (unstreamed) reply as the event lines of one chunk that says it all."""
    body = b""
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > MAX_WHOLE_BYTES:
            raise rpc_error(grpc.StatusCode.INTERNAL, f"upstream {name} answered more than {MAX_WHOLE_BYTES} bytes "
                                                      f"(MAX_WHOLE_BYTES)")
    try:
        payload = json.loads(body)
    except ValueError:
        raise rpc_error(grpc.StatusCode.INTERNAL, f"upstream {name} answered a body that is not JSON: "
                                                  f"{body[:200]!r}") from None
    yield "data: " + json.dumps(dialect.whole_chunk(payload))
    yield "data: [DONE]"


def _too_long(name: str) -> grpc.aio.AioRpcError:
    return rpc_error(grpc.StatusCode.INTERNAL, f"upstream {name} sent an event line longer than {MAX_EVENT_BYTES} "
                                               f"bytes (MAX_EVENT_BYTES)")


async def _error_body(response: httpx2.Response) -> str:
    chunks = bytearray()
    try:
        async for chunk in response.aiter_bytes():
            chunks += chunk
            if len(chunks) >= MAX_ERROR_BODY:
                break
    except httpx2.HTTPError:
        pass
    return chunks[:MAX_ERROR_BODY].decode(errors="replace")
