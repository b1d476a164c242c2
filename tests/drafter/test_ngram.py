"""Prompt-lookup drafting: exact proposals, and the incremental index equals a rescan."""

from __future__ import annotations

import random
import time

import pytest

from services.drafter.ngram import MAX_NGRAM, MAX_SPECULATIVE_TOKENS, DraftState, NgramIndex, NgramProposer


def rescan(tokens: list[int], max_ngram: int, min_ngram: int, k: int) -> list[int]:
    """Reference: for n from max to min, scan backwards for the suffix's latest earlier occurrence."""
    length = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > length - 1:
            continue
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k]
    return []


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    proposer = NgramProposer(max_ngram=3, min_ngram=1, num_speculative_tokens=2)
    # Suffix [1, 2, 3] occurred at 0..3 (followed by 4, 5); [3] alone occurred later at 6 (followed by 9).
    assert proposer.propose_for([1, 2, 3, 4, 5, 8, 3, 9, 1, 2, 3]) == [4, 5]


def test_most_recent_earlier_occurrence_is_used():
    proposer = NgramProposer(max_ngram=2, min_ngram=1, num_speculative_tokens=3)
    assert proposer.propose_for([7, 8, 1, 2, 7, 8, 5, 6, 0, 7, 8]) == [5, 6, 0]


def test_proposal_is_cut_at_the_end_of_the_sequence():
    proposer = NgramProposer(max_ngram=2, min_ngram=1, num_speculative_tokens=5)
    assert proposer.propose_for([4, 5, 6, 4, 5]) == [6, 4, 5]
    # A periodic run: the suffix [9, 9] last occurred ending one position earlier (overlapping).
    assert proposer.propose_for([9, 9, 9, 9]) == [9]


def test_no_match_proposes_nothing():
    proposer = NgramProposer(max_ngram=4, min_ngram=2, num_speculative_tokens=3)
    assert proposer.propose_for([1, 2, 3, 4, 1]) == []  # [4, 1] never occurred, and n=1 is not allowed
    assert proposer.propose_for([]) == []
    assert proposer.propose_for([1]) == []


def test_num_tokens_caps_the_proposal():
    proposer = NgramProposer(max_ngram=1, min_ngram=1, num_speculative_tokens=3)
    index = proposer.new_index([1, 2, 3, 4, 1])
    assert proposer.propose(index) == [2, 3, 4]
    assert proposer.propose(index, num_tokens=1) == [2]
    assert proposer.propose(index, num_tokens=10) == [2, 3, 4]
    assert proposer.propose(index, num_tokens=0) == []


@pytest.mark.parametrize(("max_ngram", "min_ngram", "k"), [(4, 1, 4), (3, 2, 5), (1, 1, 1), (6, 3, 2)])
def test_incremental_index_equals_a_rescan(max_ngram, min_ngram, k):
    rng = random.Random(max_ngram * 100 + min_ngram * 10 + k)
    proposer = NgramProposer(max_ngram=max_ngram, min_ngram=min_ngram, num_speculative_tokens=k)
    for _ in range(40):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
        index = proposer.new_index(tokens)
        for _ in range(15):
            assert proposer.propose(index) == rescan(tokens, max_ngram, min_ngram, k), tokens
            appended = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
            tokens += appended
            index.extend(appended)
        assert index.tokens == tokens


def test_lookup_cost_does_not_grow_with_the_sequence():
    rng = random.Random(0)
    proposer = NgramProposer(max_ngram=4, min_ngram=1, num_speculative_tokens=4)
    index = proposer.new_index(rng.randrange(1000) for _ in range(200_000))
    started = time.perf_counter()
    for _ in range(2000):
        index.extend([rng.randrange(1000)])
        proposer.propose(index)
    # A rescan of 200K tokens takes tens of milliseconds per call; 2000 indexed steps take a few.
    assert time.perf_counter() - started < 0.5


def test_draft_state_tracks_sequences():
    state = DraftState(NgramProposer(max_ngram=2, min_ngram=1, num_speculative_tokens=2))
    state.open(1, [5, 6, 7, 5])
    state.open(2, [1, 1])
    assert state.propose(1) == [6, 7]
    assert state.propose(2) == [1]
    state.append(1, [6])
    assert state.propose(1) == [7, 5]
    assert state.num_tokens(1) == 5 and len(state) == 2
    state.close(1)
    state.close(1)
    assert 1 not in state
    with pytest.raises(ValueError, match="seq_id 1 is not open"):
        state.propose(1)
    with pytest.raises(ValueError, match="seq_id 2 is already open"):
        state.open(2, [])


def test_settings_are_validated_with_their_names():
    with pytest.raises(ValueError, match="min_ngram must be in \\[1, max_ngram=2\\], got min_ngram=3"):
        NgramProposer(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="min_ngram must be"):
        NgramProposer(min_ngram=0)
    with pytest.raises(ValueError, match=f"max_ngram must be <= {MAX_NGRAM}"):
        NgramProposer(max_ngram=MAX_NGRAM + 1)
    with pytest.raises(ValueError, match=f"num_speculative_tokens must be in \\[1, {MAX_SPECULATIVE_TOKENS}\\]"):
        NgramProposer(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="index covers n-grams \\[1, 3\\], the proposer \\[1, 4\\]"):
        NgramProposer().propose(NgramIndex(1, 3))


def test_an_ngram_drafter_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys; from services.drafter.main import DrafterServicer, build_proposer; from "
            "services.drafter.config import DrafterConfig; DrafterServicer(build_proposer(DrafterConfig())); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
