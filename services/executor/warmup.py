"""Warm-up: the executor runs the shapes it will serve before it reports SERVING.

What would otherwise be paid by the first requests: Triton compiling each kernel
specialization on CUDA, torch.compile tracing the decode step's shape classes with
``--compile`` on a CPU, and the first use of every op and sampler path (allocator pools,
library handles, lazily built tables).

Everything runs through the real ``ModelRunner.execute`` on scratch state: sequences with
negative ids (the scheduler numbers its own from 0) in the first KV blocks, forgotten with a
last ``finished_seq_ids`` step. The runner is left holding no sequence; what the scratch
sequences wrote into those blocks does not matter, since the scheduler reads no block before a
sequence of its own has written it. The runner then gets a fresh sampler (the warm-up's
random draws advanced the shared generator of unseeded rows), so the first real requests
sample exactly what they would without warm-up.

The steps (block size 16: "short" sequences fit one block, "long" ones take two, so the
decode steps cover batch 1 and several, each with block tables one and two blocks wide; those
are the shape classes of the compiled decode step):

1. prefill one short prompt (greedy);
2. prefill a long prompt beside a decode row (a mixed step);
3. decode the short one alone, then the long one alone;
4. prefill a second short prompt; decode both short ones;
5. decode all three with every sampler stage: greedy, greedy with a repetition penalty, and
   seeded random sampling with temperature, top-k, top-p, min-p and logprobs.

Then the attention backend may launch the kernel buckets the steps cannot reach cheaply
(``warm_up`` of the Triton backend: every split-K partition bucket and prefill tile size), and
each forward path runs its own warm-up (the decode graphs are captured there, one per
batch-size bucket: services/executor/forward_paths/decode_graphs.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.sampling_params import SamplingParams
from services.common.step import NewSequence, RunningSequence, StepPlan
from services.executor.model_runner import ModelRunner

SHORT_PROMPT_LEN = 4
GREEDY = SamplingParams(temperature=0.0)
PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.2)
RANDOM = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=1234, logprobs=2)


@dataclass(frozen=True, slots=True)
class WarmupReport:
    seconds: float
    steps: int
    """ModelRunner steps run (the forgetting step included)."""
    kernel_launches: int
    """Launches by the attention backend's own warm-up (0 where it has none)."""
    path_facts: dict[str, Any] = field(default_factory=dict)
    """What the forward paths' own warm-ups report, as log fields (the decode graphs:
    ``graph_seconds``, ``graph_batch_sizes``)."""


def compile_cache_dirs(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Keep Triton's and inductor's compiled kernels in one stable folder, so a restart reuses them.

    The folder is ``TOKENMILL_CACHE_DIR``, else ``~/.cache/tokenmill``; a ``TRITON_CACHE_DIR`` or
    ``TORCHINDUCTOR_CACHE_DIR`` already set is kept. (Inductor's default is under /tmp, which a
    reboot may empty.) Returns the two paths in use.
    """
    root = Path(env.get("TOKENMILL_CACHE_DIR") or Path.home() / ".cache" / "tokenmill")
    env.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    return {name: env[name] for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}


class _ScratchPlans:
    """Builds the warm-up's plans and keeps each scratch sequence's length and blocks."""

    def __init__(self, runner: ModelRunner):
        self.block_size = runner.block_size
        self.num_blocks = runner.num_usable_blocks
        self.num_kv_groups = runner.kv_groups.num_groups
        self.next_block = 0
        self.next_step = -1
        self.lengths: dict[int, int] = {}  # seq id -> known tokens
        self.blocks: dict[int, list[int]] = {}

    def _take_blocks(self, seq_id: int, tokens: int) -> list[int]:
        """Blocks so that ``seq_id`` holds ``tokens``: the new ones only."""
        have = self.blocks.setdefault(seq_id, [])
        # a block of each KV group per block_size tokens (services/common/kv_groups.py)
        need = -(-tokens // self.block_size) * self.num_kv_groups - len(have)
        if self.next_block + need > self.num_blocks:
            raise _OutOfScratch
        new = list(range(self.next_block, self.next_block + need))
        self.next_block += need
        have.extend(new)
        return new

    def plan(self, new: list[tuple[int, int, SamplingParams]] = (), running: list[int] = ()) -> StepPlan:
        """One step: ``new`` as (seq id, prompt length, sampling), ``running`` decodes one token each."""
        step = StepPlan(self.next_step)
        self.next_step -= 1
        for seq_id, prompt_len, sampling in new:
            # Prompt ids from 3 up: no special token; any id is as good as another here.
            prompt = [3 + (seq_id * 7 + i) % 200 for i in range(prompt_len)]
            blocks = self._take_blocks(seq_id, prompt_len)
            step.new.append(NewSequence(seq_id, prompt, prompt_len, 0, prompt_len, blocks, sampling))
            self.lengths[seq_id] = prompt_len + 1  # the sampled token is known after the step
        for seq_id in running:
            length = self.lengths[seq_id]
            step.running.append(RunningSequence(seq_id, 1, self._take_blocks(seq_id, length)))
            self.lengths[seq_id] = length + 1
        return step


class _OutOfScratch(Exception):
    """The KV pool (or the context limit) is too small for the next warm-up step."""


def warm_up(runner: ModelRunner) -> WarmupReport:
    """Run the warm-up steps on ``runner`` (which must hold no sequence) and forget them."""
    if runner.sequences:
        raise ValueError(f"warm-up needs an idle runner; it holds sequences {sorted(runner.sequences)[:5]}")
    start = time.perf_counter()
    plans = _ScratchPlans(runner)
    short_a, long_b, short_c = -1, -2, -3
    long_len = runner.block_size + SHORT_PROMPT_LEN
    schedule = [
        lambda: plans.plan(new=[(short_a, SHORT_PROMPT_LEN, GREEDY)]),
        lambda: plans.plan(new=[(long_b, long_len, RANDOM)], running=[short_a]),
        lambda: plans.plan(running=[short_a]),
        lambda: plans.plan(running=[long_b]),
        lambda: plans.plan(new=[(short_c, SHORT_PROMPT_LEN, PENALIZED)]),
        lambda: plans.plan(running=[short_a, short_c]),
        lambda: plans.plan(running=[short_a, long_b, short_c]),
    ]
    steps = 0
    try:
        for make_plan in schedule:
            plan = make_plan()
            if max(plans.lengths.values()) > runner.max_model_len:
                break
            runner.execute(plan)
            steps += 1
    except _OutOfScratch:
        pass  # a pool this small (tests) warms up what fits
    finally:
        runner.execute(StepPlan(plans.next_step, finished_seq_ids=list(plans.lengths)))
        steps += 1
        runner.sampler.reset()
    launches = 0
    backend_warm_up = getattr(runner.backend, "warm_up", None)
    if backend_warm_up is not None:
        k_cache, v_cache = runner.kv_cache.layers[0]
        launches = backend_warm_up(k_cache, v_cache, runner.model_config.num_heads, runner.max_model_len,
                                   dtype=runner.dtype)
    path_facts: dict[str, Any] = {}
    for path in runner.paths:
        # After the eager steps: every kernel a decode graph records is compiled by now, and
        # the capture's own first launch (outside the graph) finds it in the cache.
        path_facts.update(path.warm_up())
    return WarmupReport(seconds=time.perf_counter() - start, steps=steps, kernel_launches=launches,
                        path_facts=path_facts)
