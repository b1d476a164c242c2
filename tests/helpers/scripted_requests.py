"""A hand-made continuous-batching scheduler driving a ModelRunner over scripted greedy requests.

Sequences arrive mid-run (prefill mixed into decode steps), batch sizes and block-table widths
change every few steps, blocks are appended as contexts grow and sequences are forgotten as
they finish: the shapes a serving executor sees.
"""

from __future__ import annotations

from services.common.sampling_params import SamplingParams
from services.common.step import NewSequence, RunningSequence, StepPlan
from services.executor.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)
# (arrival step, prompt length, tokens to generate): batches of 1 to 4, prompts from 1 token to
# three blocks of 16, tables one to four blocks wide, arrivals mixing prefill into decode steps.
REQUESTS = [(0, 5, 30), (3, 20, 12), (6, 1, 40), (9, 40, 20), (20, 3, 25), (45, 9, 10)]


def run_requests(runner: ModelRunner, requests=REQUESTS) -> dict[int, list[int]]:
    """A hand-made continuous-batching scheduler over REQUESTS; blocks are appended as needed."""
    free = list(range(runner.num_usable_blocks))
    tokens: dict[int, list[int]] = {}
    known: dict[int, int] = {}  # seq id -> known tokens (prompt + generated)
    blocks: dict[int, int] = {}
    step = 0
    while step == 0 or known:
        plan = StepPlan(step)
        for seq_id, (arrival, prompt_len, _) in enumerate(requests):
            if arrival == step:
                prompt = [3 + (seq_id * 31 + i * 7) % 500 for i in range(prompt_len)]
                table = [free.pop(0) for _ in range(-(-prompt_len // runner.block_size))]
                plan.new.append(NewSequence(seq_id, prompt, prompt_len, 0, prompt_len, table, GREEDY))
                known[seq_id], blocks[seq_id], tokens[seq_id] = prompt_len, len(table), []
        for seq_id in list(known):
            if any(new.seq_id == seq_id for new in plan.new):
                continue
            grow = known[seq_id] > blocks[seq_id] * runner.block_size - 1  # the token computed now needs a slot
            new_blocks = [free.pop(0)] if grow else []
            blocks[seq_id] += len(new_blocks)
            plan.running.append(RunningSequence(seq_id, 1, new_blocks))
        result = runner.execute(plan)
        for out in result.outputs:
            tokens[out.seq_id] += out.token_ids
            known[out.seq_id] += len(out.token_ids)
        for seq_id in [s for s in known if len(tokens[s]) == requests[s][2]]:
            del known[seq_id]
            plan_done = StepPlan(-step - 1, finished_seq_ids=[seq_id])
            runner.execute(plan_done)
        step += 1
        if step > 200:
            raise AssertionError("the scripted requests did not finish")
    return tokens
