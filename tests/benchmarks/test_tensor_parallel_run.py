"""The tensor-parallel run: its flags, and a short run on stories260K (two ranks, real processes)."""

from __future__ import annotations

import json

import pytest

from benchmarks import tensor_parallel

pytestmark = pytest.mark.slow


def test_bad_flags_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        tensor_parallel.main(["--tp", "1"])
    assert "--tp must be at least 2, got 1" in capsys.readouterr().err


@pytest.mark.parametrize("cpu_decode", ["eager", "fused"])
def test_a_short_run_writes_every_system_and_the_all_reduce(tmp_path, stories_dir, cpu_decode):
    out = tmp_path / "tp.json"
    assert tensor_parallel.main(["--model", str(stories_dir), "--batches", "1,4", "--steps", "2", "--rounds", "1",
                                 "--all-reduce-calls", "10", "--cpu-decode", cpu_decode, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cpu_decode"] == cpu_decode
    ranks = ["TP=2 shm, 1 thread", "TP=2 shm vocab, 1 thread"]
    if cpu_decode == "eager":
        ranks.insert(0, "TP=2 gloo, 1 thread")
    assert list(result["systems"]) == ["TP=1, 1 thread", "TP=1, 2 threads", *ranks]
    for name in ranks:
        two = result["systems"][name]
        assert set(two["ms_per_step"]) == {"1", "4"}
        assert all(0 < share < 1 for share in two["all_reduce_share"].values())
    assert {name: set(times) for name, times in result["all_reduce_alone_us"].items()} == {
        "gloo": {"1x64", "4x64"}, "shm": {"1x64", "4x64"}, "step gloo": {"1x64", "4x64"},
        "step shm": {"1x64", "4x64"}}
    assert result["command"].startswith("python -m benchmarks tensor-parallel")
