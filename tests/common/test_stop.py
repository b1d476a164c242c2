"""StopConditions: the one check of a request's stop rules, and the sampler's ban derived from them."""

from __future__ import annotations

import re

import pytest

from services.common.step import MinTokensBan
from services.scheduler.request.stop import MAX_STOP_TOKEN_IDS, StopConditions


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (StopConditions(max_tokens=0), "max_tokens must be >= 1 (or None for no limit), got 0"),
        (StopConditions(max_tokens=64), "max_tokens 64 must be below the context limit 64"),
        (StopConditions(min_tokens=-1), "min_tokens must be >= 0, got -1"),
        (StopConditions(max_tokens=2, min_tokens=3), "min_tokens=3 must not exceed max_tokens=2"),
        (StopConditions(stop=("a", "")), "stop[1] is empty; stop strings must be non-empty"),
        (StopConditions(stop="abc"), "stop must be a list of strings, got a single string"),
        (StopConditions(stop_token_ids=(99,)), "stop_token_ids entry 99 is outside [0, 16)"),
        (StopConditions(stop_token_ids=(-1,)), "stop_token_ids entry -1 is outside [0, 16)"),
        (StopConditions(stop_token_ids=(1,) * (MAX_STOP_TOKEN_IDS + 1)),
         f"stop_token_ids has {MAX_STOP_TOKEN_IDS + 1} entries; the limit MAX_STOP_TOKEN_IDS is {MAX_STOP_TOKEN_IDS}"),
    ],
)
def test_validation_names_the_field_and_the_limit(stop, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        stop.validate(vocab_size=16, max_model_len=64)


def test_valid_conditions_pass():
    StopConditions().validate(vocab_size=16, max_model_len=64)
    StopConditions(max_tokens=63, min_tokens=63, stop=("x",) * 2, stop_token_ids=(0, 15)).validate(16, 64)


@pytest.mark.parametrize(
    ("stop", "eos", "ban"),
    [
        (StopConditions(), (2,), None),  # no min_tokens: nothing banned
        (StopConditions(stop_token_ids=(5,)), (2,), None),
        (StopConditions(min_tokens=3), (2, 9), MinTokensBan(3, (2, 9))),
        (StopConditions(min_tokens=3, stop_token_ids=(5, 2)), (2, 9), MinTokensBan(3, (5, 2, 9))),
        (StopConditions(min_tokens=3, stop_token_ids=(5,), ignore_eos=True), (2,), MinTokensBan(3, (5,))),
        (StopConditions(min_tokens=3, ignore_eos=True), (2,), None),  # nothing would end it early
        (StopConditions(min_tokens=3), (), None),
    ],
)
def test_min_tokens_ban_holds_the_ids_that_would_end_the_request(stop, eos, ban):
    assert stop.min_tokens_ban(eos) == ban
