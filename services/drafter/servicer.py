"""The Drafter gRPC servicer: drafter.proto <-> a Proposer (services/drafter/proposer.py).

Propose is one long-lived stream per scheduler with a ProposerSession of its own (concurrent
streams are independent; each forgets its sequences, and frees what they hold, when it ends).
Each request message is one step and gets exactly one response, applied in this order:

1. closed_seq_ids are forgotten (unknown ids are ignored: finish and abort may both report one);
2. new_sequences are opened with every known token;
3. the accepted tokens of seq_ids are appended;
4. drafts are proposed for propose_seq_ids, in that order, in one batch: at most
   num_speculative_tokens each (0 = the configured default; larger requests are capped at it),
   possibly none.

A proposer that runs a model does all of this on one worker thread shared by every stream:
the event loop stays free for health checks and other streams' messages while a step's
forwards run, and the model, its KV pool and its free blocks have a single user.

A malformed message (unknown or duplicate sequence, mismatched packed arrays, a token outside
the draft model's vocabulary) ends the stream with INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from services.common.codec.packed import split_packed
from services.common.errors import InvalidArgumentError
from services.common.stream_session import logged_stream
from services.common.pb.tokenmill.v1 import drafter_pb2, drafter_pb2_grpc
from services.drafter.proposer import DraftMethod, Proposer, ProposerInfo, ProposerSession

_log = structlog.get_logger("tokenmill.drafter")

_METHODS = {DraftMethod.NGRAM: drafter_pb2.DRAFT_METHOD_NGRAM,
            DraftMethod.DRAFT_MODEL: drafter_pb2.DRAFT_METHOD_DRAFT_MODEL}


def info_to_pb(info: ProposerInfo) -> drafter_pb2.DrafterInfo:
    return drafter_pb2.DrafterInfo(
        method=_METHODS[info.method], num_speculative_tokens=info.num_speculative_tokens,
        draft_model_path=info.draft_model_path, ngram_min=info.ngram_min, ngram_max=info.ngram_max,
        vocab_size=info.vocab_size,
    )


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, proposer: Proposer) -> None:
        self._proposer = proposer
        self._info = info_to_pb(proposer.info())
        self._worker = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-model")
                        if proposer.runs_model else None)
        self._calls_started = 0

    async def GetDrafterInfo(
        self, request: drafter_pb2.GetDrafterInfoRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.DrafterInfo:
        return self._info

    async def Propose(
        self, request_iterator: AsyncIterator[drafter_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[drafter_pb2.ProposeResponse]:
        self._calls_started += 1
        session = self._proposer.new_session()
        loop = asyncio.get_running_loop()
        try:
            with logged_stream(_log, "propose", context, counters=("steps", "draft_tokens"),
                               final=lambda: {"open_sequences": len(session)},
                               rpc="Propose", propose_call=self._calls_started) as stream:
                async for request in request_iterator:
                    if self._worker is None:
                        response = _propose_step(session, request)
                    else:
                        response = await loop.run_in_executor(self._worker, _propose_step, session, request)
                    stream.add(steps=1, draft_tokens=len(response.draft_token_ids))
                    yield response
        finally:
            # Queued behind any step of this stream still running on the worker: its blocks are
            # freed once nothing of this stream uses them. Not awaited: a cancelled handler may
            # not await.
            if self._worker is None:
                session.close_all()
            else:
                self._worker.submit(session.close_all)


def _propose_step(session: ProposerSession, request: drafter_pb2.ProposeRequest) -> drafter_pb2.ProposeResponse:
    if request.num_speculative_tokens < 0:
        raise InvalidArgumentError(
            f"num_speculative_tokens must be >= 0 (0 = the default), got {request.num_speculative_tokens}"
        )
    num_tokens = request.num_speculative_tokens or None
    for seq_id in request.closed_seq_ids:
        session.close(seq_id)
    for index, new in enumerate(request.new_sequences):
        if new.seq_id in session:
            raise InvalidArgumentError(f"new_sequences[{index}].seq_id {new.seq_id} is already open")
        session.open(new.seq_id, list(new.token_ids))
    appended = split_packed(
        request.seq_ids, request.token_counts, request.token_ids,
        ids_field="seq_ids", counts_field="token_counts", flat_field="token_ids",
    )
    for seq_id, token_ids in appended:
        if seq_id not in session:
            raise InvalidArgumentError(f"seq_ids names {seq_id}, which is not open")
        session.append(seq_id, token_ids)
    seen: set[int] = set()
    for seq_id in request.propose_seq_ids:
        if seq_id not in session:
            raise InvalidArgumentError(f"propose_seq_ids names {seq_id}, which is not open")
        if seq_id in seen:
            raise InvalidArgumentError(f"propose_seq_ids names {seq_id} twice")
        seen.add(seq_id)
    drafts = session.propose_batch(request.propose_seq_ids, num_tokens)
    return drafter_pb2.ProposeResponse(
        step_id=request.step_id, seq_ids=request.propose_seq_ids, draft_counts=[len(d) for d in drafts],
        draft_token_ids=[t for draft in drafts for t in draft],
    )
