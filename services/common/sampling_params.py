"""Per-request sampling parameters: how the next token is drawn, a value object.

When generation ends (max_tokens, stop strings and ids, min_tokens) is not here but in
``services.scheduler.request.stop.StopConditions``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Upper bounds on user-controlled sizes; each is named in the error it produces.
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
# Past these the distribution is flat (temperature) or the logits are crushed to zero
# (repetition penalty) to float precision: such values are noise, not a request.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0


@dataclass(slots=True)
class SamplingParams:
    """How the next token is drawn from the model's distribution.

    Defaults reproduce plain sampling at temperature 1.0. ``temperature == 0`` means greedy.
    """

    temperature: float = 1.0
    """0 = greedy (argmax); otherwise logits are divided by it before softmax."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set whose probability mass reaches top_p; 1.0 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's; 0 disables."""
    repetition_penalty: float = 1.0
    """CTRL-style: logits of tokens seen in prompt or output are divided (if >0) or multiplied (if <0) by it."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated (output only)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated (output only)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to the logits of the given token ids before anything else."""
    seed: int | None = None
    """When set, the draws for this request depend only on the seed and the token position,
    never on the rest of the batch."""
    logprobs: int | None = None
    """None: no logprobs. n >= 0: the sampled token's logprob plus the n most likely alternatives."""
    prompt_logprobs: int | None = None
    """None: none. n >= 0: each prompt token's logprob given the tokens before it (the first
    token has none), plus the n most likely alternatives at each position."""
    grammar: str | None = None
    """The grammar the output is constrained to (llguidance's grammar JSON, as the scheduler
    compiled and checked it from the request's StructuredOutput); None = unconstrained. Not a
    field of the public SamplingParams message: only admission sets it."""

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the offending field and the accepted range."""
        check_sampling_params(self, vocab_size)


def check_sampling_params(params: SamplingParams, vocab_size: int) -> None:
    """The accepted range of every field, checked where a request is admitted (and again by the
    executor): a ValueError naming the offending field and the range."""
    if not (0.0 <= params.temperature <= MAX_TEMPERATURE):  # NaN fails too
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {params.temperature}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables), got {params.top_k}")
    if not (0.0 < params.top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if not (0.0 <= params.min_p <= 1.0):
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    if not (0.0 < params.repetition_penalty <= MAX_REPETITION_PENALTY):
        raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                         f"got {params.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (-2.0 <= value <= 2.0):
            raise ValueError(f"{name} must be in [-2, 2], got {value}")
    if len(params.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(
            f"logit_bias has {len(params.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS_ENTRIES}"
        )
    for token_id, bias in params.logit_bias.items():
        if not (0 <= token_id < vocab_size):
            raise ValueError(f"logit_bias token id {token_id} is outside [0, {vocab_size})")
        if not (-100.0 <= bias <= 100.0):
            raise ValueError(f"logit_bias value {bias} for token {token_id} is outside [-100, 100]")
    if params.logprobs is not None and not (0 <= params.logprobs <= MAX_LOGPROBS):
        raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {params.logprobs}")
    if params.prompt_logprobs is not None and not (0 <= params.prompt_logprobs <= MAX_LOGPROBS):
        raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {params.prompt_logprobs}")
