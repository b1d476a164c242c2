"""A run's flags from its settings dataclass, as the services get theirs.

Each run declares its settings once, as a dataclass of ``setting`` fields, each with its
docstring (its ``--help``) under it; ``parse`` builds the command line from it with
services.common.settings (flags, defaults, ``--help``), then calls the dataclass's
``validate()``, whose ValueError becomes a usage error naming the flag. Settings the engine
already declares are not declared again: the scheduler's limits are embedded whole
(``settings.embedded``), and a single executor knob is a ``config_field`` of ExecutorConfig,
which takes the name, default and help from there.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

from services.common.settings import (  # noqa: F401 (setting: a run's own settings)
    add_config_arguments,
    config_from_args,
    field_help,
    setting,
)

T = TypeVar("T")


def config_field(config_cls: type, name: str, *, default: Any = dataclasses.MISSING, note: str = "") -> Any:
    """A setting that is field ``name`` of ``config_cls``: its default (unless ``default``) and its
    help (its docstring's first paragraph), so the flag says what the engine's setting says. ``note`` is appended
    to the help (how the run uses it)."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    if name not in fields:
        raise AttributeError(f"{config_cls.__name__} has no field {name!r}")
    source = fields[name]
    help_text = field_help(config_cls, source, first_paragraph=True)
    if note:
        help_text = f"{help_text} {note}".strip()
    if default is dataclasses.MISSING:
        if source.default is not dataclasses.MISSING:
            default = source.default
        elif source.default_factory is not dataclasses.MISSING:
            return dataclasses.field(default_factory=source.default_factory, metadata={"help": help_text})
        else:
            raise TypeError(f"{config_cls.__name__}.{name} has no default: give one")
    return dataclasses.field(default=default, metadata={"help": help_text})


def build_parser(settings_cls: type, *, prog: str, description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, settings_cls)
    return parser


def parse(settings_cls: type[T], argv: Sequence[str] | None, *, prog: str, description: str | None = None) -> T:
    """The settings of ``argv``; a bad value exits with status 2 and ``prog: error: ...``."""
    parser = build_parser(settings_cls, prog=prog, description=description)
    settings = config_from_args(settings_cls, parser.parse_args(argv))
    validate = getattr(settings, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as exc:
            parser.error(str(exc))
    return settings


def flag(name: str) -> str:
    """The command-line spelling of a settings field (for messages)."""
    return "--" + name.replace("_", "-")


def check_at_least(settings: Any, minimum: int | float, *names: str) -> None:
    """ValueError naming the first of ``names`` below ``minimum``."""
    for name in names:
        value = getattr(settings, name)
        if value < minimum:
            raise ValueError(f"{flag(name)} must be at least {minimum}, got {value}")


def check_choices(name: str, values: Sequence[str] | str, known: Sequence[str]) -> None:
    """ValueError naming the flag, what is unknown and what is known."""
    given = [values] if isinstance(values, str) else list(values)
    unknown = [v for v in given if v not in known]
    if unknown or not given:
        raise ValueError(f"{flag(name)}: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
