"""The executors run: its flags and its failover part, end to end on stories260K (one stack)."""

from __future__ import annotations

import json

import pytest

from benchmarks import executors

pytestmark = pytest.mark.slow


def test_bad_flags_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        executors.main(["--parts", "scaling,bogus"])
    assert "--parts: unknown bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        executors.main(["--prompt-len", "a:b"])
    assert "--prompt-len" in capsys.readouterr().err


def test_failover_part_kills_an_executor_and_loses_no_stream(tmp_path, capsys):
    out = tmp_path / "executors.json"
    code = executors.main(["--parts", "failover", "--failover-streams", "8", "--failover-output", "96",
                           "--kv-cache-bytes", str(8 * 1024**2), "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    failover = result["failover"]
    assert failover["killed_after_s"] is not None
    assert failover["failed_streams"] == 0
    assert failover["summary"]["completed"] == 8 and failover["summary"]["requests_with_wrong_output_len"] == []
    assert result["git"] and result["command"].startswith("python -m benchmarks executors")
    assert "failover: killed at" in capsys.readouterr().out
