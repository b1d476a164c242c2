"""Speculative decoding in the engine loop: when to ask the drafter, and what to do with its answer.

Before planning a step with nothing in flight, the loop asks the drafter for drafts for the
requests ready to verify some, each up to its adaptive k (core/speculation.py); a late or
missing answer means no drafts, and a draft naming an id outside the vocabulary is cut there
(counted). A step that verifies drafts is not overlapped: where the
request's next step starts depends on how many drafts are accepted. So while any running
request still wants drafts the loop keeps one step in flight; once every request's k has
fallen to 0 (drafts do not pay), it overlaps again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.speculation import DraftLength, SpeculationConfig
from services.scheduler.engine.ports import DrafterPort


class Drafting:
    """One drafter shared by every executor of the engine: their asks take turns (the drafter
    answers one at a time), and each ask names every live sequence of all of them, so the
    drafter forgets only those that left."""

    def __init__(self, drafter: DrafterPort, speculation: SpeculationConfig,
                 live_seq_ids: Callable[[], list[int]]) -> None:
        self.drafter = drafter
        self.speculation = speculation
        self._live_seq_ids = live_seq_ids
        self._turn = asyncio.Lock()
        self.num_invalid_drafts = 0
        """Drafts cut at an id outside the vocabulary (tokenmill:spec_decode_invalid_drafts)."""

    def draft_length(self, num_speculative_tokens: int | None) -> DraftLength:
        """A new request's draft length: None = the server's cap; 0 turns speculation off for it."""
        cap = self.speculation.num_speculative_tokens
        return DraftLength(self.speculation, cap if num_speculative_tokens is None else min(cap, num_speculative_tokens))

    def speculating(self, scheduler: Scheduler) -> bool:
        """Some running request would verify drafts: keep one step in flight."""
        if not self.drafter.connected:
            return False
        return any(r.draft_length is not None and r.draft_length.wants_drafts() for r in scheduler.running)

    async def draft(self, scheduler: Scheduler) -> None:
        """Ask the drafter for the requests ready to verify drafts; set what comes back in time,
        at most each request's k."""
        if not self.drafter.connected:
            return
        asks = [(request, k) for request in scheduler.requests_ready_to_draft()
                if (k := request.draft_length.next_k()) > 0]
        if not asks:
            return
        async with self._turn:
            drafts = await self.drafter.propose(asks, self._live_seq_ids())
        if drafts is None:  # no answer in time: this step goes without drafts
            return
        vocab_size = scheduler.config.vocab_size
        for request, k in asks:
            draft = drafts.get(request.seq_id)
            if draft:
                draft = self._valid_prefix(draft[:k], vocab_size)
            if draft and not request.is_finished:
                request.spec_token_ids = draft
            elif not draft:
                request.draft_length.observe_no_draft()

    def _valid_prefix(self, draft: list[int], vocab_size: int) -> list[int]:
        """The draft up to its first id outside [0, vocab_size): a drafter's bad answer costs a
        draft, never the step (the executor would refuse the whole plan, and on a GPU an
        out-of-range id is a device-side assert)."""
        for index, token_id in enumerate(draft):
            if not 0 <= token_id < vocab_size:
                self.num_invalid_drafts += 1
                return draft[:index]
        return draft

    def forget_all(self) -> None:
        self.drafter.forget_all()
