"""Speculative verification (services/runtime/sampling/verify.py): the accept rule, and
chi-square tests over >= 10,000 draws on a small vocabulary that the verified output is
distributed as plain sampling, while a deliberately broken verifier is caught by the same test.

The "model" is a Markov chain over V = 6 tokens: p(next | prefix) = P[last token]. Two
tokens are generated after token 0 with drafts d1, d2; the plain answer is P[0][x1] P[x1][x2].
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from services.runtime.sampling.verify import emitted_tokens, num_accepted, rejection_sample
from tests.helpers.chi_square import goodness_of_fit

V = 6
N = 12_000


def markov_chain(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(V, V, generator=generator, dtype=torch.float64), dim=-1)  # [V, V]


def plain_probs(P: torch.Tensor) -> dict:
    return {(a, b): float(P[0, a] * P[a, b]) for a in range(V) for b in range(V)}


def first_two(emitted: list[int], P: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """The first two generated tokens; when the step emitted only one, the next plain step draws the second."""
    if len(emitted) >= 2:
        return emitted[0], emitted[1]
    return emitted[0], int(torch.multinomial(P[emitted[0]], 1, generator=generator))


def coupled_draws(P: torch.Tensor, drafts: list[int], seed: int, broken: bool = False) -> Counter:
    """What the executor does: t_j ~ p_j at every position, then ``emitted_tokens``. ``broken``
    resamples from p (d not excluded) on a mismatch: the classic mistake of drawing the correction
    from p instead of the residual max(0, p - q)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.stack([P[0]] + [P[d] for d in drafts])  # [k + 1, V]: p_j given d_1..d_j
    targets = torch.multinomial(rows, N, replacement=True, generator=generator).T.tolist()  # [N, k + 1]
    counts: Counter = Counter()
    for target in targets:
        emitted = emitted_tokens(target, drafts)
        accepted = len(emitted) - 1
        if broken and accepted < len(drafts):
            emitted[-1] = int(torch.multinomial(rows[accepted], 1, generator=generator))
        counts[first_two(emitted, P, generator)] += 1
    return counts


def test_accept_rule():
    assert num_accepted([5, 6, 7], [5, 6]) == 2
    assert emitted_tokens([5, 6, 7], [5, 6]) == [5, 6, 7], "all accepted: the bonus token follows"
    assert emitted_tokens([5, 9, 7], [5, 6]) == [5, 9], "the correction replaces the first wrong draft"
    assert emitted_tokens([4, 6, 7], [5, 6]) == [4], "nothing after a rejection counts"
    assert emitted_tokens([3], []) == [3]
    with pytest.raises(ValueError, match="3 target tokens for 1 drafts"):
        emitted_tokens([1, 2, 3], [1])


@pytest.mark.parametrize("drafts", [[2, 2], [1, 4], [5, 0]])
def test_coupled_verification_is_distributed_as_plain_sampling(drafts):
    P = markov_chain(1)
    counts = coupled_draws(P, drafts, seed=7)
    assert goodness_of_fit(counts, plain_probs(P)) > 0.01


def test_the_chi_square_test_catches_a_verifier_that_resamples_from_p():
    P = markov_chain(1)
    # The most likely first token as the draft: the broken rule over-weights it.
    d1 = int(P[0].argmax())
    counts = coupled_draws(P, [d1, int(P[d1].argmax())], seed=7, broken=True)
    assert goodness_of_fit(counts, plain_probs(P)) < 0.01


@pytest.mark.parametrize("one_hot", [True, False], ids=["deterministic-drafts", "drafts-from-q"])
def test_textbook_rejection_sampling_is_distributed_as_plain_sampling(one_hot):
    P = markov_chain(2)
    Q = markov_chain(3)  # a different "draft model"
    generator = torch.Generator().manual_seed(11)
    counts: Counter = Counter()
    for _ in range(N):
        if one_hot:
            drafts, q = [1, 3], None
        else:
            d1 = int(torch.multinomial(Q[0], 1, generator=generator))
            d2 = int(torch.multinomial(Q[d1], 1, generator=generator))
            drafts, q = [d1, d2], torch.stack([Q[0], Q[d1]])
        p = torch.stack([P[0], P[drafts[0]], P[drafts[1]]])
        emitted = rejection_sample(p, drafts, q, generator)
        counts[first_two(emitted, P, generator)] += 1
    assert goodness_of_fit(counts, plain_probs(P)) > 0.01
