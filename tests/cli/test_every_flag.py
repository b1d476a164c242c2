"""Every boolean flag of every service and of ``tokenmill up`` works both ways, and every path
flag is made absolute where it is typed: generated from the settings dataclasses, so a new flag
is covered without a new test.

A boolean field named ``no_demo`` once gave ``--no-demo`` and ``--no-no-demo``, both setting
False: ``tokenmill up --no-demo`` could never skip the demo."""

from __future__ import annotations

import dataclasses
import importlib
import os
import typing
from pathlib import Path

import pytest

from services.cli.serve import SERVICES
from services.cli.up import UpConfig
from services.common.settings import parse_config, to_argv
from benchmarks.gateway.simulator.config import SimulatorConfig


def _service_config(service: str) -> type:
    """The config dataclass a service's entry point parses: the one in its main module built on
    the service's process fields (service_config.service_process_fields)."""
    module = importlib.import_module(SERVICES[service])
    found = {value for value in vars(module).values()
             if isinstance(value, type) and dataclasses.is_dataclass(value)
             and any(base.__name__ == f"{service.capitalize()}ProcessFields" for base in value.__mro__)}
    assert len(found) == 1, f"{SERVICES[service]}: expected one config built on the process fields, got {found}"
    return found.pop()


CONFIGS = {**{service: _service_config(service) for service in SERVICES}, "up": UpConfig,
           "simulator": SimulatorConfig}


def _fields(config_cls: type, path: tuple[str, ...] = ()):
    """(attribute path, field, type) of every flag, through embedded configs."""
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if f.metadata.get("embedded"):
            yield from _fields(hints[f.name], path + (f.name,))
        else:
            yield path + (f.name,), f, hints[f.name]


def _get(config, path: tuple[str, ...]):
    for name in path:
        config = getattr(config, name)
    return config


BOOLEANS = [(name, path, f) for name, cls in CONFIGS.items() for path, f, tp in _fields(cls) if tp is bool]
PATH_WORDS = ("model", "file", "dir", "config", "cert", "key", "ca")


def test_the_services_and_up_have_boolean_flags_to_check():
    names = {(name, path[-1]) for name, path, _ in BOOLEANS}
    assert {("up", "demo"), ("up", "gateway"), ("up", "tls"), ("scheduler", "spec_adaptive")} <= names


@pytest.mark.parametrize(("name", "path", "f"), BOOLEANS, ids=[f"{n}-{p[-1]}" for n, p, _ in BOOLEANS])
def test_every_boolean_flag_works_both_ways(name, path, f):
    cls = CONFIGS[name]
    flag = "--" + path[-1].replace("_", "-")
    assert not path[-1].startswith(("no_", "disable_")), f"{name}: name {path[-1]} for what it turns on"
    for argv, expected in (([flag], True), (["--no-" + flag[2:]], False)):
        config = parse_config(cls, argv, env={})
        assert _get(config, path) is expected, (name, argv)
        # A launcher hands the value on with to_argv: the child must parse the same value.
        assert _get(parse_config(cls, to_argv(config), env={}), path) is expected, (name, to_argv(config))
    env = f.metadata.get("env")
    if env:
        for text, expected in (("true", True), ("false", False)):
            assert _get(parse_config(cls, [], env={env: text}), path) is expected, (name, env, text)


def test_a_boolean_named_for_what_it_turns_off_is_refused():
    @dataclasses.dataclass
    class Negative:
        no_demo: bool = False

    with pytest.raises(TypeError, match="'demo'"):
        parse_config(Negative, [], env={})


PATHS = [(name, path, f) for name, cls in CONFIGS.items() for path, f, tp in _fields(cls)
         if f.metadata.get("path")]


@pytest.mark.parametrize(("name", "path", "f"), PATHS, ids=[f"{n}-{p[-1]}" for n, p, _ in PATHS])
def test_every_path_flag_is_made_absolute_where_it_is_typed(name, path, f, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flag = "--" + path[-1].replace("_", "-")
    assert _get(parse_config(CONFIGS[name], [flag, "models/m"], env={}), path) == str(tmp_path / "models" / "m")
    env = f.metadata.get("env")
    if env:
        assert _get(parse_config(CONFIGS[name], [], env={env: "x/y.pem"}), path) == str(tmp_path / "x" / "y.pem")
    assert _get(parse_config(CONFIGS[name], [flag, ""], env={}), path) == ""  # empty stays unset


def test_every_setting_named_like_a_path_is_one():
    """A str setting whose name says file, directory, model, certificate, key or CA is marked a path
    (metadata "path"), so it cannot slip past being made absolute; the exceptions say why."""
    not_paths = {"tool_call_parser", "kv_cache_dtype", "tls_allowed_clients", "tls_peer_clients",
                 "engines",  # the simulator's inline JSON (or a file) is read at once, where typed
                 }
    missing = [f"{name}.{'.'.join(path)}" for name, cls in CONFIGS.items() for path, f, tp in _fields(cls)
               if tp is str and any(word in path[-1].split("_") for word in PATH_WORDS)
               and path[-1] not in not_paths and not f.metadata.get("path")]
    assert not missing


def test_up_passes_an_absolute_model_path_on(tmp_path, monkeypatch):
    """`make run` types `--model models/smollm2-135m-instruct-q4_1`: the gateway's routes file (in
    a directory of its own) once resolved that against its own directory."""
    monkeypatch.chdir(tmp_path)
    config = parse_config(UpConfig, ["--model", "models/smollm2", "--log-dir", "logs"], env={})
    assert config.model == str(tmp_path / "models" / "smollm2") and os.path.isabs(config.log_dir)
    assert Path(parse_config(UpConfig, [], env={"TOKENMILL_MODEL": "m"}).model) == tmp_path / "m"
