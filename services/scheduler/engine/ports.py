"""The engine core's ports: what it needs of an executor, a detokenizer and a drafter.

The services implement them with gRPC links (services/scheduler/links/), the in-process
engine with local objects (services/inprocess/ports.py); the core (core.py) drives either
the same way. Each port is small on purpose: a new transport, or a second executor behind
the same scheduler, is one more implementation, not a change to the loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from services.common.detokenize import DetokenizeBatch, DetokenizeResult
from services.common.errors import InvalidArgumentError, UnavailableError
from services.common.step import StepPlan, StepResult
from services.scheduler.request.request import Request

EXECUTOR_LOST = (UnavailableError, InvalidArgumentError)
"""What an executor port raises when its executor is gone or refused a step: the core then
ends every request on it with Finished (error) and detaches it (the supervisor reconnects)."""


class ExecutorPort(Protocol):
    """One executor. Plans go in and results come back in the same order, so the core may send
    the next plan before reading the previous result (overlapped scheduling)."""

    @property
    def connected(self) -> bool:
        """False once the executor is known to be gone (before a step fails on it)."""

    async def send(self, plan: StepPlan) -> None:
        """Hand over one plan; raises one of EXECUTOR_LOST."""

    async def receive(self, step_id: int) -> StepResult:
        """The result of the oldest plan sent and not yet received; raises one of EXECUTOR_LOST."""


@dataclass(frozen=True, slots=True)
class KVTransfer:
    """What one copy of KV blocks between executors moved."""

    num_blocks: int
    num_bytes: int
    seconds: float


class KVReceiverPort(Protocol):
    """An executor that can copy KV blocks from another one (a decode executor, from the
    prefill executor that computed a prompt), and let another copy from it."""

    async def pull_kv(self, source: str, grant: str, source_block_ids: list[int], block_ids: list[int]) -> KVTransfer:
        """Copy ``source_block_ids`` of the executor at ``source`` into this executor's
        ``block_ids`` (same layout: checked by both sides), presenting the source's ``grant``;
        raises on any failure (nothing the copy wrote is used then)."""

    async def grant_kv(self, block_ids: list[int]) -> str:
        """Let one copy read ``block_ids`` of this executor: the grant the reader presents."""

    async def revoke_kv(self, grant: str) -> None:
        """End ``grant`` (the hand-off is over, whichever way)."""


class DetokenizerPort(Protocol):
    """Where a request's text is made, and its stop strings matched (detokenize.py)."""

    @property
    def connected(self) -> bool:
        """False once its session is gone (its streams' state went with it)."""

    @property
    def accepting(self) -> bool:
        """Whether a new request may be pinned to it: connected, and not draining (a tokenizer
        stopping serves its open streams to their end, but takes no new ones)."""

    async def detokenize(self, batch: DetokenizeBatch) -> DetokenizeResult:
        """One step's text for this detokenizer's streams; raises UnavailableError when the
        detokenizer is gone (its streams' state went with it)."""


class DrafterPort(Protocol):
    """Where draft tokens come from. Only ever costs speed: no answer means no drafts."""

    @property
    def connected(self) -> bool: ...

    async def propose(self, asks: list[tuple[Request, int]], live_seq_ids: Iterable[int]) -> dict[int, list[int]] | None:
        """Drafts by seq_id for ``asks`` ((request, most drafts wanted), k >= 1), a request with
        no draft absent; None when there is no answer in time. ``live_seq_ids``: the running
        sequences; the drafter may forget the others."""

    def forget_all(self) -> None:
        """Every sequence was dropped (a new executor session: seq ids start over)."""
