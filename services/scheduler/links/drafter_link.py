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

import structlog

from services.common.pb.tokenmill.v1 import drafter_pb2, drafter_pb2_grpc
from services.common.tls import ClientTLS
from services.scheduler.links.backend_channel import BackendChannel
from services.scheduler.links.backoff import KeepConnected
from services.scheduler.links.drafter_session import DrafterSession, drafts_from, propose_message
from services.scheduler.request.request import Request

_log = structlog.get_logger("tokenmill.scheduler.drafter")

DRAFT_METHOD_NAMES = {
    drafter_pb2.DRAFT_METHOD_NGRAM: "ngram",
    drafter_pb2.DRAFT_METHOD_DRAFT_MODEL: "draft_model",
}


class DrafterLink:
    def __init__(self, address: str, deadline_s: float, tls: ClientTLS | None = None, secret: str = "") -> None:
        self.address = address
        self.backend = BackendChannel("drafter", address, tls, secret)
        self.info: drafter_pb2.DrafterInfo | None = None
        self._session: DrafterSession | None = None
        self.num_sessions = 0
        self.requests = DraftRequests(deadline_s)
        # A missing drafter only costs speed: keep trying, quietly.
        self._keeper = KeepConnected(lambda: self._connect(timeout=2.0), first_delay_s=0.1, max_delay_s=1.0,
                                     failed=lambda exc, delay: _log.debug("drafter_connect_failed", address=address,
                                                                          error=str(exc), retry_in_s=delay),
                                     name="drafter-link")

    @property
    def connected(self) -> bool:
        return self._session is not None

    @property
    def method(self) -> str:
        return DRAFT_METHOD_NAMES.get(self.info.method, "unknown") if self.info is not None else ""

    def start(self) -> None:
        """Connect in the background, and again whenever the session ends."""
        self._keeper.start()

    async def _connect(self, timeout: float) -> None:
        stub = drafter_pb2_grpc.DrafterStub(await self.backend.reopen())
        await self.backend.ready(timeout)
        self.info = await stub.GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=timeout,
                                               metadata=self.backend.metadata)
        self._session = DrafterSession(stub.Propose(metadata=self.backend.metadata), self.address, self._ended)
        self.num_sessions += 1
        _log.info("drafter_connected", address=self.address, method=self.method,
                  num_speculative_tokens=self.info.num_speculative_tokens)

    def _ended(self, session: DrafterSession) -> None:
        if self._session is session:
            self._session = None
            _log.warning("drafter_lost", address=self.address)
            self._keeper.lost()

    def forget_all(self) -> None:
        """The scheduler's sequences were all dropped (its core was rebuilt and seq ids start
        over): close every sequence the drafter holds in the next message."""
        if self._session is not None:  # a new session starts with none
            self._session.mirror.forget_all()

    async def close(self) -> None:
        self._keeper.stop()
        session, self._session = self._session, None
        if session is not None:
            session.cancel()
        await self.backend.close()

    async def propose(self, asks: list[tuple[Request, int]],
                      live_seq_ids: Iterable[int]) -> dict[int, list[int]] | None:
        """Drafts by seq_id for ``asks``, or None (``DraftRequests.propose``)."""
        return await self.requests.propose(self._session, asks, live_seq_ids)


class DraftRequests:
    """One request per step, awaited until ``deadline_s``; while one is outstanding (a late
    answer not yet in) the next steps go without asking, so the drafter never falls behind."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.num_late = 0
        """Answers that missed their deadline (dropped when they came)."""
        self.num_skipped = 0
        """Steps that went without asking because an earlier answer was still outstanding."""
        self._step_ids = itertools.count()

    async def propose(self, session: DrafterSession | None, asks: list[tuple[Request, int]],
                      live_seq_ids: Iterable[int]) -> dict[int, list[int]] | None:
        """Drafts by seq_id for ``asks`` ((request, most drafts wanted), k >= 1), a request with
        no draft absent; None when there is no answer (the drafter is away, busy with a late
        answer, or misses the deadline). ``live_seq_ids``: the scheduler's running sequences;
        the drafter forgets the others it holds."""
        if session is None or not asks:
            return None
        if session.pending is not None:
            self.num_skipped += 1
            return None
        step_id = next(self._step_ids)
        future = await session.ask(step_id, propose_message(step_id, session.mirror.batch(asks, live_seq_ids)))
        if future is None:
            return None
        try:
            response = await asyncio.wait_for(asyncio.shield(future), self.deadline_s)
        except asyncio.TimeoutError:
            self.num_late += 1
            return None
        return None if response is None else drafts_from(response)  # None: the session ended meanwhile
