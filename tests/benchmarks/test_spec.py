"""The spec benchmark's arithmetic and its flags (the run itself needs SmolLM2 and minutes)."""

from __future__ import annotations

import pytest

from benchmarks import spec
from benchmarks.__main__ import main as benchmarks
from benchmarks.spec import summarize


def row(tokens, seconds, drafts=0, draft_tokens=0, accepted=0):
    return {"tokens": tokens, "seconds": seconds, "num_drafts": drafts, "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted}


def test_summary_figures_and_speedup_keys():
    result = summarize({
        "off_copy_b1": [row(100, 10.0), row(100, 10.0)],
        "ngram_copy_b1": [row(100, 4.0, drafts=30, draft_tokens=100, accepted=70), row(100, 6.0, 30, 100, 50)],
        "off_free_b1": [row(100, 10.0)],
        "ngram_free_b1": [row(95, 10.0, drafts=10, draft_tokens=20, accepted=2)],
    })
    copy = result["cases"]["ngram_copy_b1"]
    assert copy["tokens_per_s"] == pytest.approx(20.0)
    assert copy["acceptance_rate"] == pytest.approx(0.6)
    assert copy["mean_accepted_length"] == pytest.approx(3.0)
    assert result["spec_speedup_ngram_copy_b1"] == pytest.approx((2.5 + 5 / 3) / 2), "median of the per-round ratios"
    assert result["spec_speedup_ngram_free_b1"] == pytest.approx(0.95)
    assert "spec_speedup_draft_copy_b1" not in result, "no draft-model figures were measured"


def test_the_spec_run_has_its_flags_and_the_servicess_names_for_them(capsys):
    with pytest.raises(SystemExit):
        benchmarks(["spec", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m benchmarks spec")
    assert "--draft-layers" in out and "--num-speculative-tokens" in out and "--batches" in out
    launch = spec.SpecSettings(num_speculative_tokens=3, draft_layers=2).launch("draft")
    assert launch.scheduler_args == ("--num-speculative-tokens=3",)
    assert "--draft-layers=2" in launch.drafter_args and "--method=draft_model" in launch.drafter_args
    assert spec.SpecSettings().launch("off").scheduler_args == ()
    with pytest.raises(SystemExit):
        benchmarks(["spec", "--systems", "off,eagle"])
    assert "--systems: unknown eagle; known: off, ngram, draft" in capsys.readouterr().err
