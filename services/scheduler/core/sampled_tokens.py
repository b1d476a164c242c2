"""A step's sampled tokens onto their request, with the token stop rules checked after each.

The rules are the request's ``StopConditions.token_stop`` (max_tokens, stop_token_ids, EOS,
min_tokens), then max_model_len (LENGTH). A step may bring several tokens (accepted drafts, a
multi-step burst): the ones after a stop are cut, never reported, never counted. Stop strings
are matched where the text is made (the tokenizer), not here.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.step import TokenLogprobs
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.request import Request
from services.scheduler.request.update import RequestUpdate


def append_sampled(request: Request, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None,
                   max_model_len: int) -> RequestUpdate:
    """Append one step's sampled tokens one by one, checking the stop rules after each; returns
    the update the caller hears of."""
    stop = request.stop
    outputs = request.output_token_ids  # the live lists: they grow as tokens are appended
    known = request.all_token_ids
    reason: FinishReason | None = None
    stop_reason: int | None = None
    num_appended = 0
    for token_id in token_ids:
        request.append_output_token(token_id, logprobs[num_appended] if logprobs is not None else None)
        num_appended += 1
        ended = stop.token_stop(token_id, len(outputs), request.eos_token_ids)
        if ended is None and len(known) >= max_model_len:
            ended = FinishReason.LENGTH, None
        if ended is not None:
            reason, stop_reason = ended
            break
    return RequestUpdate(
        request_id=request.request_id,
        seq_id=request.seq_id,
        new_token_ids=list(token_ids[:num_appended]),
        new_logprobs=list(logprobs[:num_appended]) if logprobs is not None else None,
        finish_reason=reason,
        stop_reason=stop_reason,
    )
