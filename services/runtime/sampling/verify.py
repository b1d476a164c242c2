"""Speculative verification: which draft tokens a step keeps, and the token that follows them.

A sequence with k drafts d_1..d_k is computed at k + 1 positions in one step; row j
(0 <= j <= k) of its logits is the target's distribution p_j for the token after the known
tokens followed by d_1..d_j. Every sampler control (bias, penalties over the history that
includes d_1..d_j, min-tokens ban at output index n + j, temperature, truncation, a seeded
row's noise for position n + j) applies to row j exactly as it would to a plain decode step
at that point, because the runner builds the rows as such steps (see ``draft_rows``).

Standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for a draft token d
drawn from q:

    accept d with probability min(1, p(d) / q(d))
    on rejection, draw from  max(0, p - q) / sum(max(0, p - q))
    if all k are accepted, draw the bonus token from p_k

Our drafts are deterministic (n-gram lookup, a greedy draft model), so q is one-hot at d:
accept with probability p(d); on rejection draw from p with d removed, renormalised.

The executor implements that one-hot case by coupling instead of a separate uniform: it
draws t_j ~ p_j with the sampler's own noise for that position and accepts d_{j+1} iff
t_j == d_{j+1}; at the first mismatch it emits t_j. P(accept) = p_j(d), and given a
rejection t_j is distributed as p_j restricted to tokens != d, renormalised: exactly the rule
above. What this buys: the emitted tokens are the very tokens plain decoding draws with the
same noise, so greedy rows (noise-free) and seeded rows (noise from (seed, position)) give
identical outputs with speculation on and off; unseeded rows are equal in distribution.
``rejection_sample`` below is the textbook rule for any q, kept as the reference the tests
hold both to (chi-square over many draws).
"""

from __future__ import annotations

import torch


def num_accepted(target_ids: list[int], draft_ids: list[int]) -> int:
    """How many drafts survive: the length of the common prefix of the target's tokens at the
    k + 1 positions (``target_ids[j]`` drawn from p_j) and the k drafts."""
    accepted = 0
    for target, draft in zip(target_ids, draft_ids):
        if target != draft:
            break
        accepted += 1
    return accepted


def emitted_tokens(target_ids: list[int], draft_ids: list[int]) -> list[int]:
    """The tokens a step emits: the accepted drafts, then the target's token after them (the
    correction at the first mismatch, or the bonus token when every draft is accepted)."""
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError(
            f"{len(target_ids)} target tokens for {len(draft_ids)} drafts: need one per position (k + 1)"
        )
    accepted = num_accepted(target_ids, draft_ids)
    return list(draft_ids[:accepted]) + [target_ids[accepted]]


def rejection_sample(
    p: torch.Tensor, draft_ids: list[int], q: torch.Tensor | None, generator: torch.Generator
) -> list[int]:
    """Textbook speculative sampling of one sequence.

    p: [k + 1, V] target probabilities per position; q: [k, V] the draft's probabilities, or
    None for deterministic drafts (one-hot at each draft). Returns the accepted drafts plus
    one token (correction or bonus).
    """
    k = len(draft_ids)
    if p.shape[0] != k + 1:
        raise ValueError(f"p has {p.shape[0]} rows for {k} drafts: need k + 1")
    out: list[int] = []
    for j, d in enumerate(draft_ids):
        q_j = q[j] if q is not None else torch.nn.functional.one_hot(torch.tensor(d), p.shape[1]).to(p.dtype)
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        # accept with min(1, p(d) / q(d)), written without a division: u * q(d) < p(d)
        if u * q_j[d].item() < p[j, d].item():
            out.append(d)
            continue
        residual = (p[j] - q_j).clamp_min(0)  # max(0, p - q), normalised by multinomial
        out.append(int(torch.multinomial(residual, 1, generator=generator).item()))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator).item()))  # the bonus token
    return out
