"""`tokenmill up --speculate K` wires speculation: the scheduler asks the (always started)
drafter for up to K drafts, and the drafter's own cap is raised to K."""

from __future__ import annotations

from services.cli.up import parse_up_config, drafter_args, scheduler_args
from services.drafter.config import DrafterConfig
from services.common.settings import parse_config
from services.scheduler.config import SchedulerServiceConfig


def test_speculate_sets_k_on_both_and_later_flags_win():
    args = parse_up_config(["--speculate", "6", "--drafter-arg=--method=draft_model"])
    assert scheduler_args(args) == ["--num-speculative-tokens=6"]
    assert drafter_args(args) == ["--num-speculative-tokens=6", "--method=draft_model"]
    plain = parse_up_config([])
    assert scheduler_args(plain) == [] and drafter_args(plain) == []
    # What the services make of them: the flags parse into their configs.
    scheduler = parse_config(SchedulerServiceConfig, scheduler_args(args) + ["--drafter-address", "127.0.0.1:1"], env={})
    assert scheduler.speculation.num_speculative_tokens == 6 and scheduler.speculation.config().num_speculative_tokens == 6
    drafter = parse_config(DrafterConfig, ["--num-speculative-tokens=6"], env={})
    assert drafter.num_speculative_tokens == 6
