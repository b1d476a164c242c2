"""`tokenmill up --chat-template`: the tokenizer gets it, a relative file's path made absolute
at the command line (the services need not run where the user typed it); inline text passes as is."""

from __future__ import annotations

import tempfile

from services.cli.up import parse_up_config, tokenizer_args
from services.common.settings import parse_config
from services.stack.launcher import LaunchConfig, Launcher
from services.tokenizer.config import TokenizerConfig
from tests.helpers.gateway_stack import CHAT_TEMPLATE


def test_a_relative_template_file_reaches_the_tokenizer_as_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the launcher's run directory goes there
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    flags = tokenizer_args(parse_up_config(["--chat-template", "chat.jinja"]))
    assert flags == [f"--chat-template={tmp_path / 'chat.jinja'}"]
    command = Launcher(LaunchConfig(model="m", tokenizer_args=flags, log_dir=str(tmp_path))).command("tokenizer")
    config = parse_config(TokenizerConfig, command[3:], env={})  # past python -m services.tokenizer
    monkeypatch.chdir("/")
    assert config.template_text() == CHAT_TEMPLATE


def test_inline_text_passes_as_typed_and_none_adds_no_flag():
    assert tokenizer_args(parse_up_config(["--chat-template", CHAT_TEMPLATE])) == [f"--chat-template={CHAT_TEMPLATE}"]
    assert tokenizer_args(parse_up_config([])) == []
