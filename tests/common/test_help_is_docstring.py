"""Each setting is declared once: the docstring under its field is its ``--help``.

Checked twice: statically over every ``setting(...)`` field in services/ and benchmarks/ (each
has a docstring under it), and on the parsers of every service and ``tokenmill up`` (each
flag's help is its field's docstring, followed only by the default/env notes).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from services.cli.up import UpConfig
from services.common.settings import add_config_arguments, attribute_docs, field_help
from services.drafter.config import DrafterConfig
from services.executor.config import ExecutorServiceConfig
from services.gateway.config import GatewayServiceConfig
from services.scheduler.config import SchedulerServiceConfig
from services.tokenizer.config import TokenizerConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = (SchedulerServiceConfig, ExecutorServiceConfig, TokenizerConfig, DrafterConfig, GatewayServiceConfig,
           UpConfig)


def _undocumented_settings(path: Path) -> list[str]:
    body_owners = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]
    missing = []
    for cls in body_owners:
        for node, after in zip(cls.body, [*cls.body[1:], None]):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Call)
                    and isinstance(node.value.func, ast.Name) and node.value.func.id == "setting"):
                continue
            documented = (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                          and isinstance(after.value.value, str))
            if not documented:
                missing.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    return missing


def test_every_setting_field_has_a_docstring_under_it() -> None:
    files = sorted((REPO_ROOT / "services").rglob("*.py")) + sorted((REPO_ROOT / "benchmarks").rglob("*.py"))
    missing = [where for path in files if "setting(" in path.read_text() for where in _undocumented_settings(path)]
    assert not missing, "settings without a docstring (their --help): " + ", ".join(missing)


def _fields(config_cls: type):
    """(declaring class, field) of each flag, embedded configs' fields included."""
    for field in dataclasses.fields(config_cls):
        if field.metadata.get("embedded"):
            yield from _fields(field.type if isinstance(field.type, type) else type(field.default_factory()))
        elif field.init:
            yield config_cls, field


@pytest.mark.parametrize("config_cls", CONFIGS, ids=lambda c: c.__name__)
def test_each_flag_help_is_its_field_docstring(config_cls: type) -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, config_cls, env={})
    helps = {action.dest: action.help.replace("%%", "%") for action in parser._actions}
    checked = 0
    for owner, field in _fields(config_cls):
        doc = attribute_docs(owner).get(field.name)
        # The fields every service process has too (services/common/service_config.py).
        assert doc is not None, f"{owner.__name__}.{field.name} has no docstring under it (its --help)"
        assert "help" not in field.metadata, f"{owner.__name__}.{field.name}: a help string beside its docstring"
        help_text = helps[field.name]
        doc = " ".join(doc.split())
        assert help_text == doc or help_text.startswith(doc + " ("), (field.name, help_text, doc)
        assert field_help(owner, field) == doc
        checked += 1
    assert checked, "no flag of its own documented by a docstring"
