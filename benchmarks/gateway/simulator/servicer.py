"""The real ``tokenmill.v1.Generation`` API over a simulated engine (simulator/engine.py).

Generate streams Started, Deltas (token ids and text " t" per token) and one Finished (reason
LENGTH, or ABORT after Abort or a cancelled call) with usage and timings, as tokenmill's
scheduler does; GetProfile and GetModelInfo answer as an engine would. Prompts are counted,
not tokenized: token ids one each, text one per four characters (at least one).
"""

from __future__ import annotations

import asyncio
import uuid

from services.common.errors import InvalidArgumentError
from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from benchmarks.gateway.simulator.engine import SimEngine
from benchmarks.gateway.simulator.profile import SimProfile

TOKEN_TEXT = " t"
FIRST_TOKEN_ID = 100
MAX_MODEL_LEN = 1 << 20


def prompt_tokens(request: generation_pb2.GenerateRequest) -> int:
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return len(request.token_ids.ids)
    if kind == "chat":
        return max(1, sum(len(m.content) for m in request.chat.messages) // 4)
    if kind == "text":
        return max(1, len(request.text) // 4)
    raise InvalidArgumentError("prompt is empty: set one of text, token_ids or chat")


class SimulatorServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: SimEngine, profile: SimProfile) -> None:
        self.engine = engine
        self.profile = profile

    async def Generate(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        max_tokens = request.stop.max_tokens if request.stop.HasField("max_tokens") else None
        if max_tokens is not None and max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be >= 1 (or None for no limit), got {max_tokens}")
        if rid in self.engine.live:
            raise InvalidArgumentError(f"request_id {rid!r} is already live")
        count = prompt_tokens(request)
        req = self.engine.submit(rid, max_tokens, count)
        done = False
        try:
            yield generation_pb2.GenerateResponse(started=generation_pb2.Started(request_id=rid, prompt_tokens=count))
            sent = 0
            while True:
                kind, value = await req.queue.get()
                if kind == "tokens":
                    ids = [FIRST_TOKEN_ID + (sent + i) % 50 for i in range(value)]
                    sent += value
                    yield generation_pb2.GenerateResponse(delta=generation_pb2.Delta(text=TOKEN_TEXT * value,
                                                                                     token_ids=ids))
                    continue
                done = True
                reason = common_pb2.FINISH_REASON_LENGTH if value.reason == "length" else common_pb2.FINISH_REASON_ABORT
                yield generation_pb2.GenerateResponse(finished=generation_pb2.Finished(
                    finish_reason=reason,
                    usage=common_pb2.Usage(prompt_tokens=count, completion_tokens=value.completion_tokens),
                    timings=common_pb2.Timings(queue_time_ms=value.queue_ms, time_to_first_token_ms=value.ttft_ms,
                                               decode_time_ms=value.decode_ms, e2e_ms=value.e2e_ms)))
                return
        finally:
            if not done:
                self.engine.abort(rid)

    async def Abort(self, request, context):
        return generation_pb2.AbortResponse(found=self.engine.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        return generation_pb2.ModelInfo(model_name=self.engine.spec.name, model_path=f"simulated/{self.engine.spec.name}",
                                        architecture="Simulated", vocab_size=50_000, max_model_len=MAX_MODEL_LEN,
                                        dtype="none", device="simulated", attention_backend="none",
                                        eos_token_ids=[2])

    async def GetProfile(self, request, context):
        if self.engine.spec.profile_delay_ms > 0:
            await asyncio.sleep(self.engine.spec.profile_delay_ms / 1000.0)
        window = request.window_seconds if request.HasField("window_seconds") else None
        snap = self.profile.snapshot(window)
        engine = self.engine
        return generation_pb2.LatencyProfile(**snap, kv_cache_usage=len(engine.running) / engine.spec.max_running,
                                             num_running=len(engine.running), num_waiting=len(engine.waiting))
