"""Config dataclass -> argparse flags with env-var defaults, and back to argv."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.common.settings import add_config_arguments, config_from_args, embedded, parse_config, setting, to_argv


class Backend(enum.Enum):
    TORCH = "torch"
    TRITON = "triton"


@dataclass
class DemoConfig:
    """Demo service settings."""

    model: Path = field(metadata={"help": "checkpoint directory", "env": "TOKENMILL_MODEL"})
    port: int = field(default=50052, metadata={"help": "gRPC port (0 = any free port)", "env": "TOKENMILL_PORT"})
    memory_fraction: float = field(default=0.9, metadata={"help": "share of memory (90% by default)", "env": "TOKENMILL_MEM"})
    backend: Backend = field(default=Backend.TORCH, metadata={"help": "attention backend", "env": "TOKENMILL_BACKEND"})
    enforce_eager: bool = field(default=False, metadata={"help": "skip graph capture", "env": "TOKENMILL_EAGER"})
    max_num_seqs: int | None = field(default=None, metadata={"help": "running batch limit", "env": "TOKENMILL_MAX_SEQS"})
    tokenizer_addresses: list[str] = field(
        default_factory=lambda: ["127.0.0.1:50051"], metadata={"help": "tokenizer host:port list", "env": "TOKENMILL_TOKENIZERS"}
    )
    stop_ids: tuple[int, ...] = field(default=(), metadata={"help": "extra stop ids"})


def test_defaults_apply_without_flags_or_env() -> None:
    config = parse_config(DemoConfig, ["--model", "/m"], env={})
    assert config == DemoConfig(model=Path("/m"))


def test_flags_parse_every_supported_type() -> None:
    config = parse_config(
        DemoConfig,
        [
            "--model=/ckpt",
            "--port", "0",
            "--memory-fraction", "0.5",
            "--backend", "triton",
            "--enforce-eager",
            "--max-num-seqs", "64",
            "--tokenizer-addresses", "a:1, b:2",
            "--stop-ids", "2,7",
        ],
        env={},
    )
    assert config == DemoConfig(
        model=Path("/ckpt"),
        port=0,
        memory_fraction=0.5,
        backend=Backend.TRITON,
        enforce_eager=True,
        max_num_seqs=64,
        tokenizer_addresses=["a:1", "b:2"],
        stop_ids=(2, 7),
    )


def test_env_overrides_default_and_flag_overrides_env() -> None:
    env = {
        "TOKENMILL_MODEL": "/from-env",
        "TOKENMILL_PORT": "7001",
        "TOKENMILL_EAGER": "yes",
        "TOKENMILL_MAX_SEQS": "none",
        "TOKENMILL_TOKENIZERS": "x:1,y:2,z:3",
        "TOKENMILL_BACKEND": "triton",
    }
    from_env = parse_config(DemoConfig, [], env=env)
    assert from_env == DemoConfig(
        model=Path("/from-env"), port=7001, enforce_eager=True, tokenizer_addresses=["x:1", "y:2", "z:3"], backend=Backend.TRITON
    )
    flagged = parse_config(DemoConfig, ["--port", "9", "--no-enforce-eager", "--model", "/cli"], env=env)
    assert (flagged.port, flagged.enforce_eager, flagged.model) == (9, False, Path("/cli"))


def test_required_field_without_flag_or_env_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(DemoConfig, [], env={})
    assert exit_info.value.code == 2
    assert "the following arguments are required: --model" in capsys.readouterr().err


def test_bad_flag_value_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(DemoConfig, ["--model", "m", "--backend", "cuda"], env={})
    assert "argument --backend: expected one of torch, triton, got 'cuda'" in capsys.readouterr().err


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"environment variable TOKENMILL_PORT='eighty' for --port"):
        parse_config(DemoConfig, ["--model", "m"], env={"TOKENMILL_PORT": "eighty"})
    with pytest.raises(ValueError, match=r"TOKENMILL_EAGER='maybe' for --enforce-eager: expected a boolean"):
        parse_config(DemoConfig, ["--model", "m"], env={"TOKENMILL_EAGER": "maybe"})


def test_help_documents_env_vars_and_effective_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(DemoConfig, ["--help"], env={"TOKENMILL_PORT": "7001"})
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert "gRPC port (0 = any free port) (default: 7001 from TOKENMILL_PORT)" in text
    assert "share of memory (90% by default) (default: 0.9; env: TOKENMILL_MEM)" in text
    assert "checkpoint directory (env: TOKENMILL_MODEL)" in text
    assert "extra stop ids (default: (empty))" in text
    assert "--enforce-eager, --no-enforce-eager" in text
    assert "--backend {torch,triton}" in text


def test_to_argv_round_trips() -> None:
    config = DemoConfig(
        model=Path("/ckpt"),
        port=0,
        backend=Backend.TRITON,
        enforce_eager=True,
        max_num_seqs=8,
        tokenizer_addresses=["a:1", "b:2"],
        stop_ids=(3,),
    )
    argv = to_argv(config)
    assert argv == [
        "--model", "/ckpt", "--port", "0", "--backend", "triton", "--enforce-eager",
        "--max-num-seqs", "8", "--tokenizer-addresses", "a:1,b:2", "--stop-ids", "3",
    ]
    assert parse_config(DemoConfig, argv, env={}) == config
    full = to_argv(DemoConfig(model=Path("/m")), only_changed=False)
    assert "--no-enforce-eager" in full and full[full.index("--max-num-seqs") + 1] == "none"
    assert parse_config(DemoConfig, full, env={"TOKENMILL_PORT": "1", "TOKENMILL_EAGER": "1"}) == DemoConfig(model=Path("/m"))


def test_prefix_lets_two_configs_share_one_parser() -> None:
    @dataclass
    class Small:
        port: int = field(default=1, metadata={"help": "port"})

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, Small, prefix="scheduler_", env={})
    add_config_arguments(parser, Small, prefix="executor_", env={})
    args = parser.parse_args(["--executor-port", "5"] + to_argv(Small(port=3), prefix="scheduler_"))
    assert config_from_args(Small, args, prefix="scheduler_") == Small(port=3)
    assert config_from_args(Small, args, prefix="executor_") == Small(port=5)


def test_unsupported_field_type_is_rejected() -> None:
    @dataclass
    class Bad:
        mapping: dict[str, int] = field(default_factory=dict)

    with pytest.raises(TypeError, match="field 'mapping': unsupported type"):
        parse_config(Bad, [], env={})


@dataclass(frozen=True)
class DemoLimits:
    max_seqs: int = field(default=4, metadata={"help": "running batch"})
    caching: bool = field(default=True, metadata={"help": "prefix cache", "env": "OTHER_CACHING"})


@dataclass
class WithLimits:
    port: int = field(default=1, metadata={"help": "port", "env": "T_PORT"})
    limits: DemoLimits = embedded(DemoLimits, env_prefix="T_")


def test_embedded_config_fields_are_flags_with_prefixed_env_vars(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_config(WithLimits, [], env={}) == WithLimits()
    config = parse_config(WithLimits, ["--max-seqs", "9"], env={"T_MAX_SEQS": "5", "OTHER_CACHING": "0"})
    assert config == WithLimits(limits=DemoLimits(max_seqs=9, caching=False))
    assert parse_config(WithLimits, [], env={"T_MAX_SEQS": "5"}).limits == DemoLimits(max_seqs=5)
    with pytest.raises(SystemExit):
        parse_config(WithLimits, ["--help"], env={})
    text = " ".join(capsys.readouterr().out.split())
    assert "running batch (default: 4; env: T_MAX_SEQS)" in text
    assert "--caching, --no-caching prefix cache (default: true; env: OTHER_CACHING)" in text
    assert "DemoLimits:" in text


def test_embedded_config_round_trips_and_takes_the_prefix() -> None:
    config = WithLimits(port=3, limits=DemoLimits(max_seqs=9, caching=False))
    assert to_argv(config) == ["--port", "3", "--max-seqs", "9", "--no-caching"]
    assert parse_config(WithLimits, to_argv(config), env={}) == config
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, WithLimits, prefix="scheduler_", env={})
    args = parser.parse_args(to_argv(config, prefix="scheduler_"))
    assert "--scheduler-max-seqs" in to_argv(config, prefix="scheduler_")
    assert config_from_args(WithLimits, args, prefix="scheduler_") == config


def test_embedded_needs_a_dataclass() -> None:
    with pytest.raises(TypeError, match="is not a dataclass"):
        embedded(int, env_prefix="T_")
    with pytest.raises(TypeError, match="must be one"):
        embedded(DemoLimits, env_prefix="T_", default=WithLimits())


@dataclass
class _Passthrough:
    child_arg: tuple[str, ...] = field(default=(), metadata={"help": "a flag for the child", "env": "T_CHILD_ARG",
                                                             "repeat": True})


def test_a_repeated_field_takes_one_item_per_flag_commas_included() -> None:
    config = parse_config(_Passthrough, ["--child-arg=--addresses=a,b", "--child-arg=--x=1"], env={})
    assert config.child_arg == ("--addresses=a,b", "--x=1")
    assert parse_config(_Passthrough, to_argv(config), env={}) == config
    assert parse_config(_Passthrough, [], env={}).child_arg == ()
    # The environment gives the first items (comma-separated there); flags add to them.
    assert parse_config(_Passthrough, ["--child-arg=--z"], env={"T_CHILD_ARG": "--x,--y"}).child_arg == (
        "--x", "--y", "--z")


@dataclass
class SmallBatch:
    limits: DemoLimits = embedded(DemoLimits, env_prefix="", default=DemoLimits(max_seqs=1))


def test_an_embedded_default_instance_gives_the_defaults_and_an_empty_prefix_no_env(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_config(SmallBatch, [], env={"MAX_SEQS": "7"}) == SmallBatch(DemoLimits(max_seqs=1))
    assert parse_config(SmallBatch, ["--max-seqs", "3"], env={}).limits == DemoLimits(max_seqs=3)
    assert to_argv(SmallBatch()) == []
    assert to_argv(SmallBatch(DemoLimits(max_seqs=4))) == ["--max-seqs", "4"]  # the class's default, not this one's
    assert parse_config(SmallBatch, to_argv(SmallBatch(DemoLimits(max_seqs=4))), env={}) == SmallBatch(DemoLimits())
    with pytest.raises(SystemExit):
        parse_config(SmallBatch, ["--help"], env={})
    text = " ".join(capsys.readouterr().out.split())
    assert "running batch (default: 1)" in text


@dataclass(frozen=True)
class _Declared:
    limit: int = setting(4, env="TEST_DECLARED_LIMIT")
    """Most things
    at once."""
    root: str = setting("", path=True)
    """A directory."""
    names: tuple[str, ...] = setting(default_factory=lambda: ("a", "b"), choices=("a", "b", "x", "y"))
    """Names, comma-separated."""


def test_setting_declares_env_and_extra_metadata_once_with_its_docstring_as_help(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = parse_config(_Declared, ["--root", "sub", "--names", "x,y"], env={"TEST_DECLARED_LIMIT": "7"})
    assert config == _Declared(limit=7, root=str(tmp_path / "sub"), names=("x", "y"))
    with pytest.raises(SystemExit):
        parse_config(_Declared, ["--help"], env={})
    out = " ".join(capsys.readouterr().out.split())
    assert "Most things at once. (default: 4; env: TEST_DECLARED_LIMIT)" in out
    assert "Names, comma-separated. (default: a,b; choices: a, b, x, y)" in out
    assert _Declared().names == ("a", "b")


def test_setting_refuses_a_help_argument() -> None:
    with pytest.raises(TypeError, match="docstring"):
        setting(1, help="most things")


def test_setting_refuses_a_mutable_default() -> None:
    with pytest.raises(TypeError, match="use a tuple"):
        setting([1, 2])
