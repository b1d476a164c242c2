"""One Propose stream to the drafter: a session, and the messages that cross it.

The drafter keeps a copy of every sequence it was sent on this session (``mirror``), so the
session's end forgets them all: a new session starts with nothing and sends sequences in full.
At most one request awaits its answer (``pending``); an answer that comes after its step gave
up on it is read and dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import grpc.aio
import structlog

from services.common.pb.tokenmill.v1 import drafter_pb2
from services.scheduler.engine.draft_mirror import DraftMirror, ProposeBatch

_log = structlog.get_logger("tokenmill.scheduler.drafter")


class DrafterSession:
    def __init__(self, call, address: str, on_end: Callable[[DrafterSession], None]) -> None:
        self.call = call
        self.address = address
        self.mirror = DraftMirror()
        """What the drafter holds of each sequence on this session."""
        self.pending: tuple[int, asyncio.Future] | None = None
        """(step id, future of its response) of the one request awaiting an answer."""
        self._on_end = on_end
        """Told once when the stream ends, unless the session was cancelled."""
        self._ended = False
        self._reader = asyncio.create_task(self._read(), name="drafter-reader")

    async def ask(self, step_id: int, message: drafter_pb2.ProposeRequest) -> asyncio.Future | None:
        """Send one request: the future of its answer (None when the session ends first), or None
        when the write failed (the session is then over)."""
        future = asyncio.get_running_loop().create_future()
        self.pending = (step_id, future)
        try:
            await self.call.write(message)
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            _log.warning("drafter_write_failed", address=self.address, error=str(exc))
            self.call.cancel()
            self._end()
            return None
        return future

    async def _read(self) -> None:
        try:
            while True:
                response = await self.call.read()
                if response is grpc.aio.EOF:
                    break
                pending = self.pending
                if pending is not None and pending[0] == response.step_id:
                    self.pending = None
                    if not pending[1].done():
                        pending[1].set_result(response)
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            _log.warning("drafter_stream_failed", address=self.address, error=str(exc))
        finally:
            self._end()

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        pending, self.pending = self.pending, None
        if pending is not None and not pending[1].done():
            pending[1].set_result(None)
        self._on_end(self)

    def cancel(self) -> None:
        """End the session without reporting it (the link closes)."""
        self._ended = True
        self.call.cancel()
        self._reader.cancel()


def propose_message(step_id: int, batch: ProposeBatch) -> drafter_pb2.ProposeRequest:
    """One step's request, the whole batch packed (drafter.proto)."""
    message = drafter_pb2.ProposeRequest(step_id=step_id, closed_seq_ids=batch.closed,
                                         propose_seq_ids=batch.propose, num_speculative_tokens=batch.num_tokens)
    for seq_id, tokens in batch.new:
        message.new_sequences.add(seq_id=seq_id, token_ids=tokens)
    for seq_id, tokens in batch.appended:
        message.seq_ids.append(seq_id)
        message.token_counts.append(len(tokens))
        message.token_ids.extend(tokens)
    return message


def drafts_from(response: drafter_pb2.ProposeResponse) -> dict[int, list[int]]:
    """Drafts by seq_id; a sequence with none is absent."""
    drafts: dict[int, list[int]] = {}
    flat = response.draft_token_ids
    start = 0
    for seq_id, count in zip(response.seq_ids, response.draft_counts):
        if count > 0:
            drafts[seq_id] = list(flat[start : start + count])
        start += count
    return drafts
