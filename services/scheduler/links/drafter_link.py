"""The scheduler's link to the drafter: one Propose stream, one message per step.

A drafter is an accelerator, never a dependency: whatever it does costs only speed.

- A step asks once, with the whole batch packed (drafter.proto): sequences the drafter has
  not seen go in full, known ones send only the tokens they gained since, and sequences
  that left the batch are closed.
- The answer is awaited until ``deadline_s``. A late answer is dropped when it arrives and
  the step goes on without drafts; while it is outstanding no new request is sent (so at
  most one is in flight and the drafter never falls further behind). Requests always carry
  the token deltas, in order, so the drafter's copy of each sequence stays exact whether or
  not an answer was used.
- When the stream ends (the drafter died, restarted or refused a message) every sequence it
  held is forgotten, the link reports no drafts, and a background task reconnects with a
  short back-off; sequences are sent in full again on the new session.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable

import grpc
import grpc.aio
import structlog

from services.common.pb.tokenmill.v1 import drafter_pb2, drafter_pb2_grpc
from services.common.internal_secret import call_metadata
from services.common.server import create_channel
from services.common.tls import ClientTLS
from services.scheduler.engine.draft_mirror import DraftMirror
from services.scheduler.links.channel import BACKEND_CHANNEL_OPTIONS
from services.scheduler.links.backoff import retry_until_connected
from services.scheduler.request.request import Request

_log = structlog.get_logger("tokenmill.scheduler.drafter")

DRAFT_METHOD_NAMES = {
    drafter_pb2.DRAFT_METHOD_NGRAM: "ngram",
    drafter_pb2.DRAFT_METHOD_DRAFT_MODEL: "draft_model",
}


class DrafterLink:
    def __init__(self, address: str, deadline_s: float, tls: ClientTLS | None = None, secret: str = "") -> None:
        self.address = address
        self.deadline_s = deadline_s
        self.tls = tls
        self._metadata = call_metadata(secret)
        """The deployment's internal secret, sent on every call (services/common/internal_secret.py)."""
        self.info: drafter_pb2.DrafterInfo | None = None
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._reader: asyncio.Task | None = None
        self._maintainer: asyncio.Task | None = None
        self._lost = asyncio.Event()
        self._mirror = DraftMirror()
        """What the drafter holds of each sequence on the current session."""
        self._pending: tuple[int, asyncio.Future] | None = None
        """(step id, future of its response) of the one request awaiting an answer."""
        self.num_late = 0
        """Answers that missed their deadline (dropped when they came)."""
        self.num_skipped = 0
        """Steps that went without asking because an earlier answer was still outstanding."""
        self.num_sessions = 0
        self._step_ids = itertools.count()

    @property
    def connected(self) -> bool:
        return self._call is not None

    @property
    def method(self) -> str:
        return DRAFT_METHOD_NAMES.get(self.info.method, "unknown") if self.info is not None else ""

    # ------------------------------------------------------------------ session
    def start(self) -> None:
        """Connect in the background, and again whenever the session ends."""
        if self._maintainer is None:
            self._maintainer = asyncio.create_task(self._maintain(), name="drafter-link")

    async def _maintain(self) -> None:
        while True:
            if self.connected:
                await self._lost.wait()
                continue
            # A missing drafter only costs speed: keep trying, quietly.
            await retry_until_connected(
                lambda: self._connect(timeout=2.0), first_delay_s=0.1, max_delay_s=1.0,
                failed=lambda exc, delay: _log.debug("drafter_connect_failed", address=self.address,
                                                     error=str(exc), retry_in_s=delay))

    async def _connect(self, timeout: float) -> None:
        await self._drop_channel()
        self._channel = create_channel(self.address, tls=self.tls, options=BACKEND_CHANNEL_OPTIONS)
        await asyncio.wait_for(self._channel.channel_ready(), timeout)
        stub = drafter_pb2_grpc.DrafterStub(self._channel)
        self.info = await stub.GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=timeout,
                                               metadata=self._metadata)
        call = stub.Propose(metadata=self._metadata)
        self._mirror.reset()
        self._pending = None
        self._lost.clear()
        self._call = call
        self.num_sessions += 1
        self._reader = asyncio.create_task(self._read(call), name="drafter-reader")
        _log.info("drafter_connected", address=self.address, method=self.method,
                  num_speculative_tokens=self.info.num_speculative_tokens)

    async def _read(self, call) -> None:
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    break
                pending = self._pending
                if pending is not None and pending[0] == response.step_id:
                    self._pending = None
                    if not pending[1].done():
                        pending[1].set_result(response)
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            _log.warning("drafter_stream_failed", address=self.address, error=str(exc))
        finally:
            self._session_ended(call)

    def _session_ended(self, call) -> None:
        if self._call is not call:
            return
        self._call = None
        self._mirror.reset()
        pending, self._pending = self._pending, None
        if pending is not None and not pending[1].done():
            pending[1].set_result(None)
        _log.warning("drafter_lost", address=self.address)
        self._lost.set()

    def forget_all(self) -> None:
        """The scheduler's sequences were all dropped (its core was rebuilt and seq ids start
        over): close every sequence the drafter holds in the next message."""
        self._mirror.forget_all()

    async def close(self) -> None:
        if self._maintainer is not None:
            self._maintainer.cancel()
            self._maintainer = None
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        await self._drop_channel()

    async def _drop_channel(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # ------------------------------------------------------------------ one step
    async def propose(self, asks: list[tuple[Request, int]],
                      live_seq_ids: Iterable[int]) -> dict[int, list[int]] | None:
        """Drafts by seq_id for ``asks`` ((request, most drafts wanted), k >= 1), a request with
        no draft absent; None when there is no answer (the drafter is away, busy with a late
        answer, or misses the deadline). ``live_seq_ids``: the scheduler's running sequences;
        the drafter forgets the others it holds."""
        call = self._call
        if call is None or not asks:
            return None
        if self._pending is not None:
            self.num_skipped += 1
            return None
        step_id = next(self._step_ids)
        batch = self._mirror.batch(asks, live_seq_ids)
        message = drafter_pb2.ProposeRequest(step_id=step_id, closed_seq_ids=batch.closed,
                                             propose_seq_ids=batch.propose,
                                             num_speculative_tokens=batch.num_tokens)
        for seq_id, tokens in batch.new:
            message.new_sequences.add(seq_id=seq_id, token_ids=tokens)
        for seq_id, tokens in batch.appended:
            message.seq_ids.append(seq_id)
            message.token_counts.append(len(tokens))
            message.token_ids.extend(tokens)
        future = asyncio.get_running_loop().create_future()
        self._pending = (step_id, future)
        try:
            await call.write(message)
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            _log.warning("drafter_write_failed", address=self.address, error=str(exc))
            call.cancel()
            self._session_ended(call)
            return None
        try:
            response = await asyncio.wait_for(asyncio.shield(future), self.deadline_s)
        except asyncio.TimeoutError:
            self.num_late += 1
            return None
        if response is None:  # the session ended while we waited
            return None
        drafts: dict[int, list[int]] = {}
        flat = response.draft_token_ids
        start = 0
        for seq_id, count in zip(response.seq_ids, response.draft_counts):
            if count > 0:
                drafts[seq_id] = list(flat[start : start + count])
            start += count
        return drafts
