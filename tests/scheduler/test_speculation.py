"""Adaptive draft length and the speculative-decoding counters of the scheduler core."""

from __future__ import annotations

import pytest

from services.common.step import SequenceOutput, StepResult
from services.scheduler.core.speculation import DraftLength, SpecDecodeStats, SpeculationConfig
from services.scheduler.request.finish_reason import FinishReason
from tests.scheduler.test_scheduler import _decoding_request, assert_all_blocks_free, make_scheduler


def test_k_follows_the_acceptance_rate_down_to_zero_and_probes():
    config = SpeculationConfig(num_speculative_tokens=5, min_acceptance=0.3, probe_interval=4, initial_acceptance=0.7)
    length = DraftLength(config, cap=8)
    assert length.cap == 5, "a request cannot ask for more than the server's cap"
    assert length.next_k() == 3  # 0.7, 0.49, 0.343 >= 0.3 > 0.24
    for _ in range(20):
        length.observe(4, 4)
    assert length.acceptance > 0.95 and length.next_k() == 5
    for _ in range(30):
        length.observe(3, 0)
    assert length.acceptance < 0.05
    assert [length.next_k() for _ in range(8)] == [0, 0, 0, 1, 0, 0, 0, 1], "k = 0, one probe every 4 steps"


def test_the_estimate_counts_only_judged_positions():
    length = DraftLength(SpeculationConfig(smoothing=1.0), cap=4)
    length.observe(4, 1)  # positions 0 and 1 judged, position 0 passed
    assert length.acceptance == pytest.approx(0.5)
    length.observe(2, 2)  # both judged, both passed
    assert length.acceptance == pytest.approx(1.0)
    length.observe(0, 0)  # nothing proposed: nothing learned
    assert length.acceptance == pytest.approx(1.0)


def test_fixed_k_and_off():
    assert DraftLength(SpeculationConfig(num_speculative_tokens=3, adaptive=False, initial_acceptance=0.0), 9).next_k() == 3
    assert DraftLength(SpeculationConfig(num_speculative_tokens=3), 0).next_k() == 0
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0"):
        SpeculationConfig(num_speculative_tokens=-1).validate()


def test_stats_per_position_and_mean_accepted_length():
    stats = SpecDecodeStats()
    stats.record(3, 2)
    stats.record(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.drafted_per_position == [2, 2, 1] and stats.accepted_per_position == [1, 1, 0]
    assert stats.mean_accepted_length == pytest.approx(2.0) and stats.acceptance_rate == pytest.approx(0.4)


def test_update_records_acceptance_and_the_request_learns_from_it():
    scheduler = make_scheduler()
    request = _decoding_request(scheduler, max_tokens=30)
    request.draft_length = DraftLength(SpeculationConfig(smoothing=1.0), 4)
    assert scheduler.requests_ready_to_draft() == [request]
    request.spec_token_ids = [21, 22, 23]
    plan = scheduler.schedule()
    assert scheduler.requests_ready_to_draft() == [], "a request with a step in flight cannot draft"
    scheduler.update(plan, StepResult(plan.step_id, [SequenceOutput(0, [21, 22, 99])]))
    stats = scheduler.get_stats().spec_decode
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert stats.accepted_per_position == [1, 1, 0]
    assert request.num_accepted_draft_tokens == 2
    assert request.draft_length.acceptance == pytest.approx(2 / 3)
    # Blocks allocated for the 1 + 3 positions stay exact: all free once the request ends.
    scheduler.finish_request("a", FinishReason.ABORT)
    assert_all_blocks_free(scheduler)


def test_drafts_through_a_whole_run_leave_no_block_behind():
    scheduler = make_scheduler()
    request = _decoding_request(scheduler, max_tokens=20)
    request.draft_length = DraftLength(SpeculationConfig(), 4)
    while scheduler.has_unfinished_requests():
        request.spec_token_ids = [5, 6, 7]
        plan = scheduler.schedule()
        scheduled = plan.running[0]
        # Accept the first draft only: block tables grow for 1 + k positions each step.
        tokens = [5, 40] if scheduled.draft_token_ids else [40]
        scheduler.update(plan, StepResult(plan.step_id, [SequenceOutput(0, tokens)]))
        used = request.num_tokens
        assert len(request.block_ids) * 4 <= used + 4 + 3, "at most the draft positions' blocks beyond the tokens"
    assert request.num_output_tokens == 20
    assert_all_blocks_free(scheduler)


def test_no_proposal_counts_as_a_rejection_so_k_falls_to_zero():
    length = DraftLength(SpeculationConfig(initial_acceptance=0.7, min_acceptance=0.3), 4)
    for _ in range(6):
        assert length.wants_drafts()
        length.observe_no_draft()
    assert not length.wants_drafts() and length.next_k() == 0
