"""The stages that only matter to sampling rows: temperature, then min-p, top-k, top-p.

Order, each stage seeing the previous one's output (vLLM v1's order):

1. temperature   ``l / T``
2. min-p         drop t if ``p(t) < min_p * max p``, i.e. ``l(t) < max l + log(min_p)``;
                 judged on the full tempered distribution
3. top-k         keep tokens whose logit is >= the k-th largest
4. top-p         on the distribution renormalized after 2-3, keep the smallest
                 most-likely-first prefix whose mass reaches top_p

Hugging Face applies min-p last (temperature, top-k, top-p, min-p); the two orders agree
whenever min-p removes only tokens that top-k/top-p keep, and differ in edge cases only.

Ties: every cut is a threshold on the logit value, so tokens tied with the last kept token
are kept too (top-k may keep more than k; top-p may keep more than the minimal prefix).
The result does not depend on how the sort orders equal values, which keeps it reproducible.

Each stage leaves at least one token: min-p and top-k keep the max; top-p keeps the first.
"""

from __future__ import annotations

import torch

from services.common.sampling.batch import SamplingBatch


def apply_temperature(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place ``logits /= T`` [B, V]; greedy rows carry T = 1 in the batch."""
    logits.div_(batch.temperature[:, None])


def apply_truncation(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Min-p, top-k and top-p as one logit threshold per row, masked in place [B, V]."""
    flags = batch.flags
    if flags.min_p:
        max_logit = logits.amax(dim=-1)  # [B]
        # log(0) = -inf, so rows with min_p = 0 keep everything.
        min_p_threshold = max_logit + torch.log(batch.min_p)  # [B]
        logits.masked_fill_(logits < min_p_threshold[:, None], float("-inf"))

    if flags.top_p:
        threshold = _top_k_top_p_threshold(logits, batch)
    elif flags.top_k:
        threshold = _top_k_threshold(logits, batch)
    else:
        return
    logits.masked_fill_(logits < threshold[:, None], float("-inf"))


def _kth_index(batch: SamplingBatch, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] index of the k-th largest clamped to [0, limit), [B] bool top-k enabled)."""
    enabled = batch.top_k > 0
    kth = (batch.top_k.clamp(1, limit) - 1)[:, None]  # [B, 1]
    return kth, enabled


def _top_k_threshold(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B] k-th largest logit (-inf where top-k is off). topk(k_max) is far cheaper than a sort."""
    top_values = logits.topk(batch.top_k_max, dim=-1).values  # [B, k_max], descending
    kth, enabled = _kth_index(batch, batch.top_k_max)
    kth_value = top_values.gather(1, kth).squeeze(1)  # [B]
    return torch.where(enabled, kth_value, float("-inf"))


def _top_k_top_p_threshold(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B] smallest logit kept by top-k followed by top-p, from one descending sort."""
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [B, V]
    kth_value = None
    if batch.flags.top_k:
        kth, enabled = _kth_index(batch, batch.vocab_size)
        kth_value = torch.where(enabled, sorted_logits.gather(1, kth).squeeze(1), float("-inf"))  # [B]
        sorted_logits.masked_fill_(sorted_logits < kth_value[:, None], float("-inf"))

    sorted_probs = sorted_logits.softmax(dim=-1)  # [B, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V], exclusive prefix sum
    # Token i stays while the tokens before it have not yet reached top_p; rows with
    # top_p = 1 keep everything (rounding could otherwise push the tail's prefix past 1).
    keep = (mass_before < batch.top_p[:, None]) | (batch.top_p[:, None] >= 1.0)  # [B, V]
    # keep is a prefix (the prefix sum never decreases) and holds position 0 (mass 0 < top_p).
    num_kept = keep.sum(dim=-1, keepdim=True)  # [B, 1]
    top_p_value = sorted_logits.gather(1, num_kept - 1).squeeze(1)  # [B]
    if kth_value is None:
        return top_p_value
    # The prefix may run into the -inf tail that top-k masked (top_p = 1, or a kept mass that
    # rounds just below top_p); the top-k cut must still hold there.
    return torch.maximum(top_p_value, kth_value)
