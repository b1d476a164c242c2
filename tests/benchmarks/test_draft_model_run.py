"""The draft-model benchmark's measurements on stories260K: timing rows, and the acceptance
count of a full-depth draft (the target itself) is every drafted token."""

from __future__ import annotations

from benchmarks.draft_model import acceptance, greedy_continuation, make, time_proposals


def test_timing_and_acceptance_of_a_full_depth_draft(stories_dir):
    proposer = make(stories_dir, 0, 3)
    row = time_proposals(proposer, batch=2, prompt_len=20, iterations=4)
    assert set(row) == {"first_ms", "all_accepted_ms", "none_accepted_ms", "all_accepted_min_ms",
                        "none_accepted_min_ms"} and min(row.values()) > 0
    assert proposer.pool.num_free == proposer.pool.num_blocks  # the session freed its blocks
    prompt = [1, 403, 407]
    target = greedy_continuation(proposer, prompt, 13)
    drafted, accepted, steps = acceptance(proposer, prompt, target, 3)
    # Every draft is right: 3 drafts + 1 target token a step, the last step cut to what is left.
    assert (drafted, accepted, steps) == (3 + 3 + 3 + 1, 10, 4)
    # A draft of one layer is a different model: it cannot agree everywhere.
    assert acceptance(make(stories_dir, 1, 3), prompt, target, 3)[1] < 10
