"""The stages that edit logits before the greedy argmax: bias, min_tokens ban, penalties.

Order (vLLM / Hugging Face conventions), each stage seeing the previous one's output:

1. logit_bias            ``l[t] += bias[t]``                      (OpenAI ``logit_bias``)
2. min_tokens ban        ``l[stop] = -inf`` while len(output) < min_tokens
3. repetition penalty    for t in prompt ∪ output: ``l / r`` if l > 0 else ``l * r``
                         (CTRL / HF ``RepetitionPenaltyLogitsProcessor``)
4. frequency + presence  ``l[t] -= frequency * count_out(t) + presence * [count_out(t) > 0]``
                         (OpenAI semantics: output tokens only)

Greedy rows take their argmax after stage 4, so penalties change greedy output too.

Every function works in place on a contiguous float32 ``[B, V]`` tensor and touches only the
(row, token) pairs listed in the batch, so a stage costs O(tokens listed), not O(B * V),
except frequency/presence, which counts into a dense ``[B, V]`` buffer (see there why).
"""

from __future__ import annotations

import torch

from services.runtime.sampling.batch import SamplingBatch


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Stages 1-4 above, in place on ``logits`` [B, V] float32 contiguous."""
    flat = logits.view(-1)  # [B * V]; the batch's indices are row * V + token
    flags = batch.flags
    if flags.logit_bias:
        apply_logit_bias(flat, batch)
    if flags.min_tokens_ban:
        apply_min_tokens_ban(flat, batch)
    if flags.repetition_penalty:
        apply_repetition_penalty(flat, batch)
    if flags.frequency_presence:
        apply_frequency_presence_penalties(logits, batch)


def apply_logit_bias(flat_logits: torch.Tensor, batch: SamplingBatch) -> None:
    """``flat_logits[i] += bias`` at every biased (row, token); pairs are unique per row."""
    assert batch.bias_index is not None and batch.bias_value is not None
    flat_logits.index_put_((batch.bias_index,), batch.bias_value, accumulate=True)


def apply_min_tokens_ban(flat_logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Stop tokens get -inf in rows that have not yet generated ``min_tokens`` tokens."""
    assert batch.ban_index is not None
    flat_logits.index_fill_(0, batch.ban_index, float("-inf"))


def apply_repetition_penalty(flat_logits: torch.Tensor, batch: SamplingBatch) -> None:
    """HF semantics: divide positive logits by the penalty, multiply negative ones.

    A token repeated in the history appears several times in ``seen_index``; the gather
    reads the unpenalized value for every copy and the scatter writes the same result for
    every copy, so repeats are harmless and no de-duplication (a sort) is needed.
    """
    index = batch.seen_index
    assert index is not None
    rows = torch.div(index, batch.vocab_size, rounding_mode="floor")  # [N_seen]
    penalty = batch.repetition_penalty[rows]  # [N_seen]
    values = flat_logits[index]  # [N_seen]
    penalized = torch.where(values > 0, values / penalty, values * penalty)
    flat_logits.index_put_((index,), penalized)


def apply_frequency_presence_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """OpenAI semantics over output tokens: ``l -= frequency * count + presence * (count > 0)``.

    Counts are accumulated into a dense [B, V] buffer: adding 1.0s is exact in any order,
    so the result is bitwise reproducible even where the scatter uses atomics, and the
    penalty is one multiply per entry instead of a sum of per-occurrence subtractions.
    """
    index = batch.output_index
    if index is None:  # the rows with these penalties have no output yet (a prompt's first token)
        return
    counts = torch.zeros_like(logits)  # [B, V]
    counts.view(-1).index_put_((index,), torch.ones_like(index, dtype=logits.dtype), accumulate=True)
    penalty = counts * batch.frequency_penalty[:, None]  # [B, V]
    penalty += (counts > 0) * batch.presence_penalty[:, None]
    logits -= penalty
