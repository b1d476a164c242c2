"""Whether a request can ever be served by this model: the one check before a scheduler core
queues it (Scheduler.add_request), against the executor's facts (SchedulerConfig)."""

from __future__ import annotations

from services.scheduler.request.request import Request


def check_fits_model(request: Request, max_model_len: int, vocab_size: int) -> None:
    """Raise ValueError naming the field and the limit when the request cannot be served: its
    sampling parameters and stop conditions (each type's own validate), then the prompt and the
    EOS ids against the model's limits."""
    request.sampling.validate(vocab_size)
    request.stop.validate(vocab_size, max_model_len)
    prompt = request.prompt_token_ids
    prompt_len = len(prompt)
    if prompt_len == 0:
        raise ValueError("prompt_token_ids is empty: a prompt needs at least one token")
    if prompt_len >= max_model_len:
        raise ValueError(
            f"prompt length {prompt_len} (prompt_token_ids) must be below "
            f"max_model_len={max_model_len} to leave room for one output token"
        )
    max_tokens = request.stop.max_tokens
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ValueError(
            f"prompt length {prompt_len} + max_tokens={max_tokens} = {prompt_len + max_tokens} "
            f"exceeds max_model_len={max_model_len}"
        )
    # min/max run in C; the per-token loop only runs to name the offending id.
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        for index, token_id in enumerate(prompt):
            if not (0 <= token_id < vocab_size):
                raise ValueError(f"prompt_token_ids[{index}] = {token_id} is outside [0, {vocab_size})")
    for token_id in request.eos_token_ids:
        if not (0 <= token_id < vocab_size):
            raise ValueError(f"eos_token_ids entry {token_id} is outside [0, {vocab_size})")
