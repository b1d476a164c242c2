"""The Drafter gRPC servicer: drafter.proto <-> the n-gram DraftState of services/drafter/ngram.py.

Propose is one long-lived stream per scheduler with a DraftState of its own (concurrent
streams are independent; each forgets its sequences when it ends). Each request message is
one step and gets exactly one response, applied in this order:

1. closed_seq_ids are forgotten (unknown ids are ignored: finish and abort may both report one);
2. new_sequences are opened with every known token;
3. the accepted tokens of seq_ids are appended;
4. drafts are proposed for propose_seq_ids, in that order: at most num_speculative_tokens each
   (0 = the configured default; larger requests are capped at it), possibly none.

A malformed message (unknown or duplicate sequence, mismatched packed arrays) ends the stream
with INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog

from services.common.codec.packed import split_packed
from services.common.errors import InvalidArgumentError
from services.common.stream_session import logged_stream
from services.common.pb.tokenmill.v1 import drafter_pb2, drafter_pb2_grpc
from services.drafter.ngram import DraftState, NgramProposer

_log = structlog.get_logger("tokenmill.drafter")


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, proposer: NgramProposer) -> None:
        self._proposer = proposer
        self._info = drafter_pb2.DrafterInfo(
            method=drafter_pb2.DRAFT_METHOD_NGRAM,
            num_speculative_tokens=proposer.num_speculative_tokens,
            ngram_min=proposer.min_ngram,
            ngram_max=proposer.max_ngram,
        )
        self._calls_started = 0

    async def GetDrafterInfo(
        self, request: drafter_pb2.GetDrafterInfoRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.DrafterInfo:
        return self._info

    async def Propose(
        self, request_iterator: AsyncIterator[drafter_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[drafter_pb2.ProposeResponse]:
        self._calls_started += 1
        state = DraftState(self._proposer)
        with logged_stream(_log, "propose", context, counters=("steps", "draft_tokens"),
                           final=lambda: {"open_sequences": len(state)},
                           rpc="Propose", propose_call=self._calls_started) as stream:
            async for request in request_iterator:
                response = self._propose_step(state, request)
                stream.add(steps=1, draft_tokens=len(response.draft_token_ids))
                yield response

    def _propose_step(self, state: DraftState, request: drafter_pb2.ProposeRequest) -> drafter_pb2.ProposeResponse:
        if request.num_speculative_tokens < 0:
            raise InvalidArgumentError(
                f"num_speculative_tokens must be >= 0 (0 = the default), got {request.num_speculative_tokens}"
            )
        num_tokens = request.num_speculative_tokens or None
        for seq_id in request.closed_seq_ids:
            state.close(seq_id)
        for index, new in enumerate(request.new_sequences):
            if new.seq_id in state:
                raise InvalidArgumentError(f"new_sequences[{index}].seq_id {new.seq_id} is already open")
            state.open(new.seq_id, list(new.token_ids))
        appended = split_packed(
            request.seq_ids, request.token_counts, request.token_ids,
            ids_field="seq_ids", counts_field="token_counts", flat_field="token_ids",
        )
        for seq_id, token_ids in appended:
            if seq_id not in state:
                raise InvalidArgumentError(f"seq_ids names {seq_id}, which is not open")
            state.append(seq_id, token_ids)
        counts: list[int] = []
        drafts: list[int] = []
        for seq_id in request.propose_seq_ids:
            if seq_id not in state:
                raise InvalidArgumentError(f"propose_seq_ids names {seq_id}, which is not open")
            draft = state.propose(seq_id, num_tokens)
            counts.append(len(draft))
            drafts.extend(draft)
        return drafter_pb2.ProposeResponse(
            step_id=request.step_id, seq_ids=request.propose_seq_ids, draft_counts=counts, draft_token_ids=drafts
        )
