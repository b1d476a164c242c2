"""The internal secret's file (services/common/internal_secret.py): refused when others may read
it, when it is short or not one word; written private and never over an existing one; and the
flag every internal service takes, with its environment variable."""

from __future__ import annotations

import stat

import pytest

from services.common.internal_secret import MIN_CHARS, call_metadata, load_secret, write_secret_file
from services.common.settings import parse_config
from services.drafter.config import DrafterConfig
from services.executor.config import ExecutorServiceConfig
from services.scheduler.config import SchedulerServiceConfig
from services.tokenizer.config import TokenizerConfig


def test_a_written_secret_is_private_random_and_loads(tmp_path) -> None:
    path = write_secret_file(tmp_path / "secret")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = load_secret(str(path))
    assert len(secret) >= MIN_CHARS and secret != load_secret(str(write_secret_file(tmp_path / "other")))
    with pytest.raises(FileExistsError):
        write_secret_file(path)
    assert call_metadata(secret) == (("x-tokenmill-internal-secret", secret),) and call_metadata("") is None


@pytest.mark.parametrize(("text", "mode", "message"), [
    ("a" * 64, 0o644, "open to others or writable by its group \\(mode 0644\\)"),
    ("a" * 64, 0o660, "open to others or writable by its group"),
    ("a" * 31, 0o600, f"one word of at least {MIN_CHARS} printable characters"),
    ("a" * 20 + " " + "b" * 20, 0o600, "one word"),
])
def test_an_unfit_secret_file_is_refused_naming_the_flag(tmp_path, text, mode, message) -> None:
    path = tmp_path / "secret"
    path.write_text(text)
    path.chmod(mode)
    with pytest.raises(ValueError, match="--internal-secret-file .*" + message):
        load_secret(str(path))
    with pytest.raises(ValueError, match="--internal-secret-file .*cannot read it"):
        load_secret(str(tmp_path / "missing"))


def test_every_service_that_holds_or_presents_it_takes_the_flag_and_variable(tmp_path) -> None:
    for config, env, required in ((TokenizerConfig, "TOKENMILL_TOKENIZER_", True),
                                  (ExecutorServiceConfig, "TOKENMILL_EXECUTOR_", True),
                                  (DrafterConfig, "TOKENMILL_DRAFTER_", True),
                                  (SchedulerServiceConfig, "TOKENMILL_SCHEDULER_", False)):
        flag, variable = str(tmp_path / "flag"), str(tmp_path / "variable")
        assert parse_config(config, ["--internal-secret-file", flag], env={}).internal_secret_file == flag
        parsed = parse_config(config, [], env={env + "INTERNAL_SECRET_FILE": variable})
        assert parsed.internal_secret_file == variable and parsed.internal_secret_required is required
