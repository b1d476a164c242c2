"""What the executor checks of a Step session before any of it reaches the model.

The scheduler is trusted to plan well, but the executor checks everything a plan could use to
reach memory or kernels out of bounds, before the plan is queued on the worker: every token id
inside the vocabulary the runner samples from, prompt and computed lengths within the known
tokens and the context, scheduled tokens covered by the block table, block ids inside the pool
and none twice in one table, sampling parameters in their ranges, burst lengths bounded. (The
runner checks a plan against the sequences it holds, too.) A plan that fails is refused with
INVALID_ARGUMENT naming the field, and the session ends.

Who may open the session at all is the port's business (mTLS and --tls-allowed-clients,
services/common/peer_identity.py); that a session which stops talking cannot hold the only
executor for good is ``idle_limited``: the scheduler's link sends an empty step while it has
nothing to run (links/step_stream.py, STEP_HEARTBEAT_S), so only a session that went silent
for ``idle_timeout_s`` is ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from services.common.errors import DeadlineExceededError, InvalidArgumentError
from services.common.kv_groups import first_needed_block
from services.common.step import ExecutorInfo, NewSequence, RunningSequence, StepPlan

MAX_STEPS_PER_PLAN = 64
"""Most decode steps one running sequence may ask for in one plan (the scheduler's cap)."""

T = TypeVar("T")


def check_plan(plan: StepPlan, info: ExecutorInfo) -> None:
    """Raise InvalidArgumentError naming the first field of ``plan`` outside ``info``'s bounds."""
    for index, new in enumerate(plan.new):
        _check_new(f"new[{index}]", new, info)
    for index, running in enumerate(plan.running):
        _check_running(f"running[{index}]", running, info)


def _check_new(where: str, new: NewSequence, info: ExecutorInfo) -> None:
    num_tokens = len(new.token_ids)
    if not 1 <= num_tokens <= info.max_model_len:
        _refuse(f"{where}.token_ids has {num_tokens} tokens; a sequence has 1 to max_model_len={info.max_model_len}")
    _check_ids(f"{where}.token_ids", new.token_ids, info.vocab_size)
    if not 1 <= new.prompt_len <= num_tokens:
        _refuse(f"{where}.prompt_len {new.prompt_len} must be in [1, {num_tokens}] (its known tokens)")
    if not 0 <= new.num_computed_tokens < num_tokens:
        _refuse(f"{where}.num_computed_tokens {new.num_computed_tokens} must be in [0, {num_tokens}): at least the "
                "last known token is computed by the step")
    end = new.num_computed_tokens + new.num_scheduled_tokens
    if new.num_scheduled_tokens < 1 or end > num_tokens:
        _refuse(f"{where}.num_scheduled_tokens {new.num_scheduled_tokens} from {new.num_computed_tokens} must reach "
                f"no further than its {num_tokens} known tokens (and be >= 1)")
    _check_blocks(f"{where}.block_ids", new.block_ids, info)
    groups = len(info.kv_group_windows)
    needed = -(-end // info.block_size) * groups
    if len(new.block_ids) < needed:
        _refuse(f"{where}.block_ids has {len(new.block_ids)} blocks; {end} tokens need {needed}")
    # Window groups' entries before the first window this sequence reads are never read or
    # written (a prefix hit leaves placeholders there): the rest must be distinct.
    first = min((first_needed_block(new.num_computed_tokens, w, info.block_size)
                 for w in info.kv_group_windows if w), default=0)
    live = [b for i, b in enumerate(new.block_ids) if not info.kv_group_windows[i % groups] or i // groups >= first]
    if len(set(live)) != len(live):
        _refuse(f"{where}.block_ids names a block twice: {list(new.block_ids)}")
    try:
        new.sampling.validate(info.vocab_size)
    except ValueError as exc:
        _refuse(f"{where}.sampling: {exc}")
    if new.min_tokens_ban is not None:
        _check_ids(f"{where}.stop_token_ids", new.min_tokens_ban.token_ids, info.vocab_size)


def _check_running(where: str, running: RunningSequence, info: ExecutorInfo) -> None:
    if not 1 <= running.num_scheduled_tokens <= info.max_model_len:
        _refuse(f"{where}.num_scheduled_tokens {running.num_scheduled_tokens} must be in [1, {info.max_model_len}]")
    if not 1 <= running.num_steps <= MAX_STEPS_PER_PLAN:
        _refuse(f"{where}.num_steps {running.num_steps} must be in [1, {MAX_STEPS_PER_PLAN}]")
    _check_ids(f"{where}.draft_token_ids", running.draft_token_ids, info.vocab_size)
    _check_blocks(f"{where}.new_block_ids", running.new_block_ids, info)


def _check_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        index, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        _refuse(f"{field}[{index}] = {bad} is outside the vocabulary [0, {vocab_size})")


def _check_blocks(field: str, block_ids: Sequence[int], info: ExecutorInfo) -> None:
    if block_ids and (min(block_ids) < 0 or max(block_ids) >= info.num_blocks):
        index, bad = next((i, b) for i, b in enumerate(block_ids) if not 0 <= b < info.num_blocks)
        _refuse(f"{field}[{index}] = {bad} is outside the KV pool of {info.num_blocks} blocks")


def _refuse(message: str) -> None:
    raise InvalidArgumentError(message)


async def idle_limited(messages: AsyncIterator[T], idle_timeout_s: float) -> AsyncIterator[T]:
    """``messages`` as they come; DeadlineExceededError once none came for ``idle_timeout_s``
    (0 = wait for ever)."""
    iterator = messages.__aiter__()
    while True:
        try:
            if idle_timeout_s > 0:
                message = await asyncio.wait_for(iterator.__anext__(), idle_timeout_s)
            else:
                message = await iterator.__anext__()
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise DeadlineExceededError(f"the Step session sent nothing for {idle_timeout_s:g} s "
                                        "(step_idle_timeout_s); it is ended so another can start") from None
        yield message
