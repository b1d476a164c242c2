"""An OpenAI-compatible HTTP API over a simulated engine, so that gateways that speak only HTTP
(LiteLLM's Router, Portkey's gateway) can be measured in front of the same simulated pool.

    POST /v1/chat/completions   streamed (``data:`` chunks, then ``[DONE]``) and not
    GET  /v1/models

A reply is ``max_tokens`` tokens of " t" (the engine has no EOS), ``finish_reason`` "length",
``model`` the engine's name (so a client sees which engine served it), and OpenAI's usage. The
prompt is counted as the gRPC servicer counts it: one token per four characters.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from benchmarks.gateway.simulator.engine import SimEngine
from benchmarks.gateway.simulator.servicer import TOKEN_TEXT


def _prompt_tokens(messages: list) -> int:
    text = sum(len(m.get("content") or "") for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
    return max(1, text // 4)


def build_app(engine: SimEngine) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    name = engine.spec.name

    async def chat(request: Request):
        body = await request.json()
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            return JSONResponse({"error": {"message": f"max_tokens must be >= 1, got {max_tokens!r}",
                                           "type": "invalid_request_error", "param": "max_tokens",
                                           "code": None}}, status_code=400)
        prompt = _prompt_tokens(body.get("messages") or [])
        rid = uuid.uuid4().hex
        req = engine.submit(rid, max_tokens, prompt)
        head = {"id": f"chatcmpl-{rid}", "created": int(time.time()), "model": name}
        if body.get("stream"):
            return StreamingResponse(_chunks(engine, req, head, prompt), media_type="text/event-stream")
        try:
            generated = 0
            while True:
                kind, value = await req.queue.get()
                if kind == "tokens":
                    generated += value
                    continue
                break
        finally:
            engine.abort(rid)  # a no-op once finished; frees the slot of a client that went away
        usage = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
        return JSONResponse({**head, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": TOKEN_TEXT * generated},
             "finish_reason": "length", "logprobs": None}]})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                         "owned_by": "simulator"}]})

    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    return app


async def _chunks(engine: SimEngine, req, head: dict, prompt: int) -> AsyncIterator[bytes]:
    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
        payload = {**head, "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n".encode()

    generated = 0
    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            kind, value = await req.queue.get()
            if kind == "tokens":
                generated += value
                yield chunk({"content": TOKEN_TEXT * value})
                continue
            usage = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
            yield chunk({}, "length", usage)
            yield b"data: [DONE]\n\n"
            return
    finally:
        engine.abort(req.request_id)
