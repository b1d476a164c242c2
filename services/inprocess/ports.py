"""The engine core's ports in one process: the model runner, a local detokenizer, a local drafter.

The same EngineCore the scheduler service drives over gRPC (services/scheduler/engine/) runs
over these, so the in-process engine differs from the services in transport only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from services.common.detokenize import DetokenizeBatch, DetokenizeResult
from services.common.step import StepPlan, StepResult
from services.drafter.proposer import Proposer
from services.executor.model_runner import ModelRunner
from services.scheduler.engine.draft_mirror import DraftMirror
from services.scheduler.request.request import Request
from services.tokenizer.detokenizer import DetokenizerPool
from services.tokenizer.text_tokenizer import TextTokenizer


class LocalExecutor:
    """Runs each plan on one worker thread, in the order sent, as the executor service does:
    the next plan can be handed over while one runs (overlapped scheduling), and the loop's
    Python runs while the model computes outside the GIL."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inprocess-executor")
        self._running: deque[Future] = deque()

    @property
    def connected(self) -> bool:
        return True

    async def send(self, plan: StepPlan) -> None:
        self._running.append(self._worker.submit(self.runner.execute, plan))

    async def receive(self, step_id: int) -> StepResult:
        """The oldest plan's result; the model runner's own exceptions propagate as they are
        (in one process a failed step is a bug to see, not a backend to reconnect)."""
        return await asyncio.wrap_future(self._running.popleft())

    def close(self) -> None:
        self._worker.shutdown(wait=True)


class LocalDetokenizer:
    """The tokenizer service's DetokenizerPool, called directly."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._pool = DetokenizerPool(tokenizer)

    @property
    def connected(self) -> bool:
        return True

    @property
    def accepting(self) -> bool:
        return True

    async def detokenize(self, batch: DetokenizeBatch) -> DetokenizeResult:
        return self._pool.apply(batch)


class LocalDrafter:
    """A proposer (n-gram lookup or a draft model) called directly, fed the same diffs the
    drafter service gets."""

    def __init__(self, proposer: Proposer) -> None:
        self._session = proposer.new_session()
        self._mirror = DraftMirror()

    @property
    def connected(self) -> bool:
        return True

    async def propose(self, asks: list[tuple[Request, int]], live_seq_ids: Iterable[int]) -> dict[int, list[int]]:
        batch = self._mirror.batch(asks, live_seq_ids)
        session = self._session
        for seq_id in batch.closed:
            session.close(seq_id)
        for seq_id, tokens in batch.new:
            session.open(seq_id, tokens)
        for seq_id, tokens in batch.appended:
            session.append(seq_id, tokens)
        drafts = session.propose_batch(batch.propose, batch.num_tokens)
        return {seq_id: draft for seq_id, draft in zip(batch.propose, drafts) if draft}

    def forget_all(self) -> None:
        self._mirror.forget_all()
