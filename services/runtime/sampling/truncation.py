"""The stages that only matter to sampling rows: temperature, then min-p, top-k, top-p.

Order, each stage seeing the previous one's output (vLLM v1's order):

1. temperature   ``l / T``
2. min-p         drop t if ``p(t) < min_p * max p``, i.e. ``l(t) < max l + log(min_p)``;
                 judged on the full tempered distribution
3. top-k         keep tokens whose logit is >= the k-th largest
4. top-p         on the distribution renormalized after 2-3, keep the smallest
                 most-likely-first prefix whose mass reaches top_p

Hugging Face applies min-p last (temperature, top-k, top-p, min-p). Min-p's cut is the same
in both orders (it compares ratios to the max, which renormalization leaves unchanged); what
differs is top-p, which here sees the distribution already narrowed by min-p and may
therefore keep a few more tokens.

Cost: top-k uses ``topk(max k)``; top-p needs a full sort, done only for the rows that use it.

Ties: every cut is a threshold on the logit value, so tokens tied with the last kept token
are kept too (top-k may keep more than k; top-p may keep more than the minimal prefix).
The result does not depend on how the sort orders equal values, which keeps it reproducible.

Each stage leaves at least one token: min-p and top-k keep the max; top-p keeps the first.
"""

from __future__ import annotations

import torch

from services.runtime.sampling.batch import SamplingBatch


def apply_temperature(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place ``logits /= T`` [B, V]; greedy rows carry T = 1 in the batch."""
    logits.div_(batch.temperature[:, None])


def apply_truncation(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Min-p, then top-k and top-p as one logit threshold per row, masked in place [B, V]."""
    flags = batch.flags
    if flags.min_p:
        max_logit = logits.amax(dim=-1)  # [B]
        # log(0) = -inf, so rows with min_p = 0 keep everything.
        min_p_threshold = max_logit + torch.log(batch.min_p)  # [B]
        logits.masked_fill_(logits < min_p_threshold[:, None], float("-inf"))
    if not (flags.top_k or flags.top_p):
        return

    if flags.top_k:
        threshold = _top_k_threshold(logits, batch)  # [B]
    else:
        threshold = torch.full((batch.size,), float("-inf"), device=logits.device)
    if flags.top_p:
        rows = batch.top_p_rows
        if rows is None:
            threshold = _top_p_threshold(logits, batch.top_p, threshold)
        else:  # sort only the rows that use top-p
            row_threshold = _top_p_threshold(logits[rows], batch.top_p[rows], threshold[rows])  # [R]
            threshold = threshold.index_copy(0, rows, row_threshold)
    logits.masked_fill_(logits < threshold[:, None], float("-inf"))


def _top_k_threshold(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B] k-th largest logit (-inf where top-k is off). topk(k_max) is far cheaper than a sort."""
    top_values = logits.topk(batch.top_k_max, dim=-1).values  # [B, k_max], descending
    kth = (batch.top_k.clamp(1, batch.top_k_max) - 1)[:, None]  # [B, 1]
    kth_value = top_values.gather(1, kth).squeeze(1)  # [B]
    return torch.where(batch.top_k > 0, kth_value, float("-inf"))


def _top_p_threshold(logits: torch.Tensor, top_p: torch.Tensor, top_k_threshold: torch.Tensor) -> torch.Tensor:
    """[R] smallest logit kept by top-p, on the distribution left after the top-k cut.

    logits [R, V] (min-p already applied), top_p [R], top_k_threshold [R] (-inf where off).
    """
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [R, V]
    sorted_logits.masked_fill_(sorted_logits < top_k_threshold[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)  # [R, V], renormalized after top-k
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [R, V], exclusive prefix sum
    # Token i stays while the tokens before it have not yet reached top_p; rows with
    # top_p = 1 keep everything (rounding could otherwise push the tail's prefix past 1).
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)  # [R, V]
    # keep is a prefix (the prefix sum never decreases) and holds position 0 (mass 0 < top_p),
    # except where top_p rounds to 0 in the logits' dtype (1e-300 is 0.0 in fp32): the most
    # likely token is always kept.
    num_kept = keep.sum(dim=-1, keepdim=True).clamp_(min=1)  # [R, 1]
    top_p_value = sorted_logits.gather(1, num_kept - 1).squeeze(1)  # [R]
    # The prefix may run into the -inf tail that top-k masked (top_p = 1, or a kept mass that
    # rounds just below top_p); the top-k cut must still hold there.
    return torch.maximum(top_p_value, top_k_threshold)
