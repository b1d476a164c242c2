"""The executor's running sequences, and a step plan's diffs applied to them.

The model runner keeps every running sequence between steps (token ids, block table, computed
count, sampling parameters), so a plan carries new sequences in full and running ones as deltas
(services/common/step.py). ``apply_plan`` checks each diff before it changes anything a kernel
reads: a block id outside the pool, drafts that do not follow the last known token or lie
outside the vocabulary, more scheduled tokens than known ones or than the block table holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.sampling_params import SamplingParams
from services.common.step import MinTokensBan, RunningSequence, StepPlan


@dataclass(slots=True)
class SequenceState:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    min_tokens_ban: MinTokensBan | None
    matcher: Any = None
    """The grammar matcher of a constrained sequence (services/runtime/sampling/grammar.py),
    having consumed exactly its outputs between steps; None when unconstrained."""
    grammar_error: str | None = None
    """Why the sequence's grammar cannot go on (its matcher did not build, or failed at a
    limit): each of its outputs carries it, and the scheduler ends its request with it."""
    adapter: str = ""
    """Its LoRA adapter's name ("" = the base model)."""
    adapter_error: str | None = None
    """Why its adapter cannot be applied (unloaded, its files gone): like grammar_error, the
    scheduler ends its request with it; its rows meanwhile run on the base model alone."""


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """What a plan is checked against."""

    num_blocks: int
    """Blocks of the pool the scheduler is told about."""
    block_size: int
    vocab_size: int


Scheduled = list[tuple[SequenceState, int]]
"""The step's rows: (sequence, tokens scheduled), new sequences first."""


def apply_plan(sequences: dict[int, SequenceState], plan: StepPlan, limits: PoolLimits
               ) -> tuple[Scheduled, dict[int, list[int]]]:
    """Apply the plan's diffs to ``sequences``: the scheduled rows, and the draft tokens by row."""
    for seq_id in plan.finished_seq_ids:
        sequences.pop(seq_id, None)
    scheduled: Scheduled = []
    drafts: dict[int, list[int]] = {}
    for new in plan.new:
        if new.seq_id in sequences:
            raise ValueError(f"sequence {new.seq_id} is already running in the executor")
        _check_block_ids(new.seq_id, new.block_ids, limits)
        state = SequenceState(
            new.seq_id, list(new.token_ids), new.prompt_len, list(new.block_ids),
            new.num_computed_tokens, new.sampling, new.min_tokens_ban, adapter=new.adapter,
        )
        sequences[new.seq_id] = state
        scheduled.append((state, new.num_scheduled_tokens))
    for running in plan.running:
        state = sequences.get(running.seq_id)
        if state is None:
            raise ValueError(f"step {plan.step_id} continues unknown sequence {running.seq_id}")
        _check_block_ids(running.seq_id, running.new_block_ids, limits)
        state.block_ids.extend(running.new_block_ids)
        if running.num_steps > 1:
            _check_multi_step(state, running, limits)
        if running.draft_token_ids:
            _take_drafts(state, running.num_scheduled_tokens, running.draft_token_ids, limits)
            drafts[len(scheduled)] = running.draft_token_ids
        scheduled.append((state, running.num_scheduled_tokens))
    for state, n in scheduled:
        _check_scheduled(state, n, limits)
    return scheduled, drafts


def _check_block_ids(seq_id: int, block_ids, limits: PoolLimits) -> None:
    # Kernels index the pool with these ids: one outside it must never reach a kernel.
    num_blocks = limits.num_blocks
    for block in block_ids:
        if not 0 <= block < num_blocks:
            raise ValueError(f"sequence {seq_id}: block id {block} is outside the KV pool of {num_blocks} blocks")


def _take_drafts(state: SequenceState, num_scheduled: int, draft_ids: list[int], limits: PoolLimits) -> None:
    """Append a running sequence's drafts to its tokens for this step: they are just more
    scheduled tokens after the last known one (which has no K/V yet)."""
    if num_scheduled != 1 + len(draft_ids):
        raise ValueError(f"sequence {state.seq_id}: {num_scheduled} scheduled tokens with "
                         f"{len(draft_ids)} drafts; expected 1 + {len(draft_ids)}")
    if state.num_computed_tokens + 1 != len(state.token_ids):
        raise ValueError(f"sequence {state.seq_id}: drafts must follow the last known token, but "
                         f"{len(state.token_ids) - state.num_computed_tokens} tokens are not computed")
    vocab = limits.vocab_size
    for index, token_id in enumerate(draft_ids):
        if not 0 <= token_id < vocab:
            raise ValueError(f"sequence {state.seq_id}: draft_token_ids[{index}] = {token_id} is "
                             f"outside [0, {vocab})")
    state.token_ids.extend(draft_ids)


def _check_multi_step(state: SequenceState, running: RunningSequence, limits: PoolLimits) -> None:
    """n decode steps back to back: a decode of the last known token, with blocks for all n positions."""
    if running.num_scheduled_tokens != 1 or running.draft_token_ids \
            or state.num_computed_tokens + 1 != len(state.token_ids):
        raise ValueError(f"sequence {state.seq_id}: {running.num_steps} decode steps need a decode of its last "
                         f"known token (1 scheduled token, no drafts); it schedules "
                         f"{running.num_scheduled_tokens} from {state.num_computed_tokens} of "
                         f"{len(state.token_ids)} known tokens")
    end = state.num_computed_tokens + running.num_steps
    if end > len(state.block_ids) * limits.block_size:
        raise ValueError(f"sequence {state.seq_id}: {running.num_steps} decode steps reach position {end - 1}, "
                         f"which needs {-(-end // limits.block_size)} blocks; its block table has "
                         f"{len(state.block_ids)}")


def _check_scheduled(state: SequenceState, n: int, limits: PoolLimits) -> None:
    end = state.num_computed_tokens + n
    if n <= 0 or end > len(state.token_ids):
        raise ValueError(
            f"sequence {state.seq_id}: {n} scheduled tokens from {state.num_computed_tokens} "
            f"exceed its {len(state.token_ids)} known tokens"
        )
    if end > len(state.block_ids) * limits.block_size:
        raise ValueError(
            f"sequence {state.seq_id}: {end} tokens need {-(-end // limits.block_size)} blocks, "
            f"its block table has {len(state.block_ids)}"
        )
