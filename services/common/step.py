"""The step contract between the scheduler (who decides) and the executor (who computes).

Pure Python values, no torch and no protobuf: the in-process engine hands these objects to
the model runner directly; the services convert them to packed protobuf arrays at the edge.

A step is a diff against the executor's state. New sequences come in full; running ones
send only what changed (how many tokens to compute now, newly appended block ids);
``finished_seq_ids`` lists sequences the executor must forget (finished, aborted or
preempted). Every sequence obeys one rule: ``num_computed_tokens`` catches up with the
number of known tokens. A prompt, a prefill chunk, a decode token and k+1 speculative
tokens are the same thing of different sizes.

The executor runs steps strictly in the order it receives them and appends each sampled
token to its sequence before the next step, so a running sequence's next input token never
travels: the scheduler may plan step N+1 before it has seen step N's result (overlapped
scheduling), scheduling one more token for a sequence whose last token only the executor
knows yet. Such a step may also compute a token for a sequence the scheduler finds finished
in step N's result; the executor needs no special case: the scheduler drops that output and
lists the sequence in a later plan's ``finished_seq_ids``. Running plans in order is also
what lets the scheduler reuse a freed block in the next plan while an earlier step may
still write to it (see the scheduler core's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.adapters import AdapterInfo
from services.common.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class MinTokensBan:
    """The sampler's share of a request's stop rules: while fewer than ``min_tokens`` tokens
    were generated, the logits of ``token_ids`` are set to -inf.

    Derived by the request's stop conditions (``StopConditions.min_tokens_ban``); a request that bans nothing has None instead.
    """

    min_tokens: int
    token_ids: tuple[int, ...]
    """The stop token ids, plus the model's EOS ids unless ignore_eos."""


@dataclass(slots=True)
class NewSequence:
    """A sequence the executor has not seen (or forgot after a preemption)."""

    seq_id: int
    token_ids: list[int]
    """Every known token: the prompt, plus tokens generated before a preemption."""
    prompt_len: int
    """How many of token_ids are prompt (the rest are output, for the penalties)."""
    num_computed_tokens: int
    """Tokens whose K/V already sit in the blocks (prefix-cache hit); computation starts here."""
    num_scheduled_tokens: int
    """Tokens to compute this step, starting at num_computed_tokens."""
    block_ids: list[int]
    """The block table: physical block ids, in order, covering at least the computed + scheduled tokens."""
    sampling: SamplingParams
    min_tokens_ban: MinTokensBan | None = None
    """Ids the sampler may not draw before min_tokens outputs (StopConditions.min_tokens_ban)."""
    adapter: str = ""
    """The LoRA adapter its every forward adds (its name on the executor); "" = the base model."""


@dataclass(slots=True)
class RunningSequence:
    """A sequence the executor already holds: only the delta."""

    seq_id: int
    num_scheduled_tokens: int
    """Tokens to compute this step, from the executor's computed count on; they may end with
    the token the executor sampled in the previous step (which the scheduler may not know)."""
    new_block_ids: list[int] = field(default_factory=list)
    """Blocks appended to the end of its block table this step."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative tokens to verify after the last known token (num_scheduled_tokens = 1 + len)."""
    num_steps: int = 1
    """Decode steps to run back to back (multi-step scheduling): after the step's token, the
    executor feeds each token it samples back in, num_steps forwards in all, and returns
    num_steps tokens. Only for a decode: num_scheduled_tokens 1 and no drafts; the block table
    covers every position those forwards write."""


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new: list[NewSequence] = field(default_factory=list)
    running: list[RunningSequence] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.new) + sum(
            s.num_scheduled_tokens for s in self.running
        )

    @property
    def is_empty(self) -> bool:
        return not self.new and not self.running


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of one sampled token and the top alternatives (ids and logprobs, best first)."""

    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class SequenceOutput:
    """What one scheduled sequence produced this step.

    ``token_ids`` is empty for a prefill chunk that did not reach the end of the known tokens.
    After speculative verification it holds the accepted draft tokens plus one sampled token.
    """

    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    """Set when the sequence cannot go on (its grammar matcher failed): the scheduler ends its
    request with this error and ignores its tokens."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """When the sequence asked for them (SamplingParams.prompt_logprobs): one entry per position
    p of this step's chunk whose next token p + 1 is a prompt token, in order (the logprob of
    prompt token p + 1 given tokens 0..p). A recomputed prompt sends them again."""


@dataclass(slots=True)
class StepResult:
    step_id: int
    outputs: list[SequenceOutput] = field(default_factory=list)
    """One entry per scheduled sequence, in plan order (new first, then running)."""
    execute_seconds: float = field(default=0.0, compare=False)
    """Time the executor spent running the plan (all its forwards and sampling, not queueing);
    0 when not measured. Multi-step scheduling sizes its bursts from it. Left out of equality:
    two runs of one plan give the same result in different times."""


@dataclass(frozen=True, slots=True)
class ExecutorInfo:
    """What the executor tells the scheduler once per session: its KV pool and the model's limits."""

    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    dtype: str
    device: str
    attention_backend: str
    model: str
    architecture: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    kv_cache_dtype: str = ""
    """K/V storage: the model's dtype name, or "int8" / "fp8_e4m3" when quantized."""
    kv_cache_bytes: int = 0
    """Bytes of the KV pool (all layers, K and V, scales included)."""
    role: str = "mixed"
    """What the scheduler runs on it: "prefill" (prompts, then their KV moves to a decode
    executor), "decode" (requests whose prompt another executor computed), or "mixed" (both)."""
    kv_layout: str = ""
    """The KV pool's layout (model, layers, kv heads, head size, block size, storage dtype):
    KV blocks copy only between executors that report the same one."""
    kv_group_windows: tuple[int, ...] = (0,)
    """Per KV group, its layers' sliding window in tokens, 0 for full attention
    (services/common/kv_groups.py): block tables interleave the groups' blocks, and a window
    group's blocks behind the window go back to the pool."""
    max_loras: int = 0
    """LoRA adapters it holds resident at once: the most distinct adapters one step may use
    (0 = it serves none)."""
    adapters: tuple[AdapterInfo, ...] = ()
    """The adapters it has loaded (resident or not), as of this report."""

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.block_size
