"""TokenizerLink's unary calls outlive a cancelled caller (a fake tokenizer in this process).

A Generate handler is cancelled when its client goes away, possibly while its prompt's Encode
is in flight. The Encode call must then run to its end rather than be cancelled with it:
grpcio's asyncio layer leaks a batch's C memory when the coroutine awaiting the batch is
cancelled (services/scheduler/clients.py, ``run_to_end``). Seen from the tokenizer, a call
cancelled with its caller is a handler cancelled mid-call; a call run to its end is answered.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.pb.tokenmill.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.scheduler.links.tokenizer_link import TokenizerLink

pytestmark = pytest.mark.asyncio


class HeldTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Encode and RenderChat answer only once ``release`` is set; ``ended`` says how each call ended."""

    def __init__(self) -> None:
        self.received = asyncio.Event()
        self.release = asyncio.Event()
        self.ended: list[str] = []

    async def _held(self):
        self.received.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise
        self.ended.append("answered")

    async def Encode(self, request, context):
        await self._held()
        return tokenizer_pb2.EncodeResponse(token_ids=[1, 2, 3])

    async def RenderChat(self, request, context):
        await self._held()
        return tokenizer_pb2.RenderChatResponse(token_ids=[1, 2, 3])


@pytest.mark.parametrize("method", ["encode", "render_chat"])
async def test_a_unary_call_runs_to_its_end_when_its_caller_is_cancelled(method: str) -> None:
    tokenizer = HeldTokenizer()
    server = grpc.aio.server()
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(tokenizer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    link = TokenizerLink(f"127.0.0.1:{port}")
    try:
        prompts = link.prompts
        call = prompts.encode("Once upon a time", True) if method == "encode" else prompts.render_chat([], True)
        caller = asyncio.create_task(call)
        await asyncio.wait_for(tokenizer.received.wait(), 10)
        caller.cancel()  # the client of the Generate call went away
        with pytest.raises(asyncio.CancelledError):
            await caller  # the caller is not kept waiting for the call
        tokenizer.release.set()
        for _ in range(500):
            if tokenizer.ended:
                break
            await asyncio.sleep(0.01)
        assert tokenizer.ended == ["answered"]
    finally:
        await link.close()
        await server.stop(grace=0)
