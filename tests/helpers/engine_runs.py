"""Running the in-process engine to completion in tests."""

from __future__ import annotations

from services.inprocess.engine import Engine
from services.scheduler.request.delta import GenerationDelta


def generate_all(engine: Engine, prompts, sampling=None, stop=None) -> list[GenerationDelta]:
    """Run ``prompts`` to completion; one merged delta (all text and tokens, the final
    reason, usage and timings) per prompt, in order."""
    prompts = list(prompts)
    merged = [GenerationDelta(request_id="") for _ in prompts]
    for i, delta in engine.generate(prompts, sampling, stop):
        m = merged[i]
        m.request_id = delta.request_id
        m.text += delta.text
        m.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            m.logprobs = (m.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            m.prompt_logprobs = (m.prompt_logprobs or []) + delta.prompt_logprobs
        if delta.finished:
            m.finish_reason, m.stop_reason = delta.finish_reason, delta.stop_reason
            m.usage, m.timings = delta.usage, delta.timings
    return merged
