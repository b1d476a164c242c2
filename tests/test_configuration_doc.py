"""docs/configuration.md is generated from the settings dataclasses: this fails when a setting
was added or its help changed without regenerating the page, and says how to regenerate it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gen_configuration_doc  # noqa: E402


def test_the_committed_page_is_current():
    result = subprocess.run([sys.executable, "scripts/gen_configuration_doc.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (
        f"docs/configuration.md is stale: run {gen_configuration_doc.COMMAND}\n{result.stderr}")


def test_the_page_lists_every_command_and_known_settings():
    text = (ROOT / "docs" / "configuration.md").read_text()
    for command in ["tokenmill up", *(f"tokenmill serve {s}" for s in gen_configuration_doc.SERVICES)]:
        assert f"## `{command}`" in text
    for flag, env in (("--max-num-seqs", "TOKENMILL_MAX_NUM_SEQS"), ("--demo` / `--no-demo", None),
                      ("--model", "TOKENMILL_MODEL")):
        assert flag in text
        assert env is None or env in text
    assert str(ROOT) not in text, "a default shows this checkout's absolute path"


def test_a_stale_page_fails_the_check_naming_the_command(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(gen_configuration_doc.render().replace("--max-num-seqs", "--max-seqs"))
    monkeypatch.setattr(gen_configuration_doc, "OUTPUT", tmp_path / "configuration.md")
    monkeypatch.setattr(gen_configuration_doc, "ROOT", tmp_path)
    assert gen_configuration_doc.main(["--check"]) == 1
    assert gen_configuration_doc.COMMAND in capsys.readouterr().err
    assert gen_configuration_doc.main([]) == 0
    assert gen_configuration_doc.main(["--check"]) == 0
